"""Tasks: reversal and GSM8K rewards, answer extraction, the registry, and the data order."""

from __future__ import annotations

import json

import pytest

from rv_train.tasks import CharTokenizer, Example, Task, TaskContext, get_task, prompt_indices, task_names
from rv_train.tasks.gsm8k import GSM8K, extract_gold, extract_prediction, follows_format, load_jsonl
from rv_train.tasks.reversal import Reversal, position_credit

# --- reversal --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "finished", "reward"),
    [
        ("4321", True, 1.0),  # all four digits and the EOS right after them
        ("4321", False, 0.8),  # ran out of tokens: no EOS credit
        ("4322", True, 0.8),
        ("43", True, 0.4),  # stopped early: two digits, EOS in the wrong place
        ("43210", False, 0.8),  # one digit too many
        ("", True, 0.0),
        ("\ufffd321", True, 0.8),  # a sampled special token counts as a wrong digit
    ],
)
def test_reversal_partial_credit(completion, finished, reward):
    assert position_credit(completion, "4321", finished) == pytest.approx(reward)


def test_reversal_examples_prompt_and_vocabulary():
    task = Reversal(TaskContext(seed=3, options={"digits": "5", "examples": "20"}))
    examples = task.examples()
    assert len(examples) == 20 and task.max_new_tokens == 6
    assert examples == Reversal(TaskContext(seed=3, options={"digits": "5", "examples": "20"})).examples()
    first = examples[0]
    assert first.prompt.endswith("=") and first.answer == first.prompt[:-1][::-1]
    tok = task.builtin_tokenizer()
    assert tok.vocab_size == 14 and tok.eos_ids == (12,) and tok.pad_id == 13
    assert tok.encode_prompt("12=") == [tok.bos_id, 1, 2, 10]
    assert task.score(first.answer, True, first) == {"reversal": 1.0}


def test_copy_task_is_one_small_file():
    copy = get_task("copy")(TaskContext(seed=0, options={"examples": "3"}))
    example = copy.examples()[0]
    assert example.answer == example.prompt[:-1]
    assert copy.score(example.answer, True, example) == {"copy": 1.0}


def test_char_tokenizer_unknown_characters():
    strict = CharTokenizer("ab")
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        strict.encode_prompt("abc")
    lenient = CharTokenizer("ab?", unknown="?")
    assert lenient.encode_prompt("a€") == [lenient.bos_id, 0, 2]
    assert lenient.decode([0, 1, lenient.eos_id]) == "ab\ufffd"


# --- GSM8K -----------------------------------------------------------------------------------------


def test_gold_answer_extraction():
    assert extract_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_gold("... #### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        extract_gold("no marker")


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("so 3 + 4 = 7\n#### 7", 7.0),
        ("#### 1,234.", 1234.0),
        ("first #### 5 then #### 6", 6.0),  # the last marker wins
        ("The answer is \\boxed{42}.", 42.0),
        ("She has 3 apples and buys 4, so 7 apples", 7.0),  # lenient: the last number
        ("#### $-3.50", -3.5),
        ("no digits here", None),
    ],
)
def test_prediction_extraction(text, number):
    assert extract_prediction(text) == number


def test_format_reward_wants_the_marker_on_the_last_line():
    assert follows_format("work\n#### 12\n")
    assert not follows_format("#### 12 apples")
    assert not follows_format("#### 12\nthanks")
    assert not follows_format("")


def test_gsm8k_from_jsonl_and_scores(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}, {"question": "1+1?", "answer": "#### 2"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    task = GSM8K(TaskContext(data_path=str(path), options={"format_weight": "0.2"}))
    examples = task.examples()
    assert [e.answer for e in examples] == ["5", "2"]
    assert examples[0].prompt.startswith("What is 2+3?") and "####" in examples[0].prompt
    assert task.score("2 plus 3\n#### 5", True, examples[0]) == {"correct": 1.0, "format": 0.2}
    assert task.score("it is 5", True, examples[0]) == {"correct": 1.0, "format": 0.0}
    assert task.score("#### 6", True, examples[0]) == {"correct": 0.0, "format": 0.2}


def test_gsm8k_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_jsonl(str(path))
    with pytest.raises(ValueError, match="--data-path"):
        GSM8K(TaskContext())


# --- registry --------------------------------------------------------------------------------------


def test_registry_lists_builtin_tasks_and_rejects_unknown_names():
    assert {"reversal", "copy", "gsm8k"} <= set(task_names())
    with pytest.raises(ValueError, match=r"unknown task 'revers'.*reversal"):
        get_task("revers")


def test_task_from_a_file_or_a_module(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text(
        "from rv_train.tasks import Task, Example\n"
        "class Echo(Task):\n"
        "    def examples(self):\n"
        "        return [Example('hi', 'hi')]\n"
        "    def score(self, completion, finished, example):\n"
        "        return {'echo': float(completion == example.answer)}\n"
        "NotATask = dict\n",
        encoding="utf-8",
    )
    cls = get_task(f"{path}:Echo")
    assert issubclass(cls, Task) and cls(TaskContext()).examples() == [Example("hi", "hi")]
    assert get_task("rv_train.tasks.reversal:Reversal") is Reversal
    with pytest.raises(ValueError, match="not a Task subclass"):
        get_task(f"{path}:NotATask")


# --- data order ------------------------------------------------------------------------------------


def test_prompt_order_is_a_permutation_per_epoch_and_resumable():
    n = 10
    epoch0 = prompt_indices(n, seed=1, start=0, count=n)
    assert sorted(epoch0) == list(range(n))
    assert prompt_indices(n, 1, 0, 25) == epoch0 + prompt_indices(n, 1, 10, 15)
    assert prompt_indices(n, 1, 10, 10) != epoch0  # each epoch is reshuffled
    assert prompt_indices(n, 2, 0, n) != epoch0
    # Rank slices of one global batch are contiguous: two ranks × 3 prompts = the 6 of one rank.
    assert prompt_indices(n, 1, 4, 3) + prompt_indices(n, 1, 7, 3) == prompt_indices(n, 1, 4, 6)
