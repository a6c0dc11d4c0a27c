import pytest
from hypothesis import given
from hypothesis import strategies as st

from rv.errors import UsageError
from rv.timespec import (
    DEFAULT_TIME,
    format_slurm_time,
    mem_megabytes,
    parse_duration,
    parse_mem,
    parse_slurm_time,
    scale_mem,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800),
        ("2h", 7200),
        ("1d12h", 129600),
        ("90s", 90),
        ("1h30m", 5400),
        ("1.5h", 5400),
        ("2H", 7200),
        (" 45min ", 2700),
        ("2 hours", 7200),
        ("2:59:00", 10740),
        ("59:00", 3540),  # MM:SS, as Slurm reads it: 59 minutes, not 59 hours
        ("1-12:00:00", 129600),
        ("1-12", 129600),  # D-HH
        ("1-12:30", 131400),  # D-HH:MM
        (DEFAULT_TIME, 10740),
    ],
)
def test_parse_duration_accepts_the_documented_forms(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "2x", "1:2:3:4", "-5m", "2h-", "1.5", "0m", "0:00", "m"])
def test_parse_duration_refuses_garbage_naming_value_and_forms(text):
    with pytest.raises(UsageError) as err:
        parse_duration(text)
    assert repr(text) in err.value.message
    assert "30m" in (err.value.hint or "")


def test_bare_number_is_refused_because_slurm_reads_minutes():
    with pytest.raises(UsageError) as err:
        parse_duration("90")
    assert "90 minutes" in err.value.message
    assert "90m" in err.value.hint


@pytest.mark.parametrize("text", ["0", "0s", "0m", "00", "0h0m", "0:00"])
def test_zero_where_zero_means_everything(text):
    # `rv gc --older-than 0`: every run that has ended. It was refused ("--time '0' has no unit").
    assert parse_duration(text, flag="--older-than", allow_zero=True) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5", "--older-than '5' has no unit"),
        ("2x", "cannot read --older-than '2x'"),
        ("-1d", "cannot read --older-than '-1d'"),
    ],
)
def test_each_error_names_the_flag_the_user_typed(text, message):
    with pytest.raises(UsageError) as err:
        parse_duration(text, flag="--older-than", allow_zero=True)
    assert err.value.message == message  # no "--time", and no Slurm reading of a bare number
    with pytest.raises(UsageError) as err:
        parse_duration("0s", flag="--lead")
    assert err.value.message == "--lead '0s' is zero"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "00:00:00"), (59, "00:00:59"), (10740, "02:59:00"), (86400, "1-00:00:00"), (266400, "3-02:00:00")],
)
def test_format_slurm_time(seconds, text):
    assert format_slurm_time(seconds) == text


def test_format_slurm_time_refuses_negative():
    with pytest.raises(ValueError):
        format_slurm_time(-1)


@given(st.integers(min_value=1, max_value=400 * 86400))
def test_format_then_parse_round_trips(seconds):
    text = format_slurm_time(seconds)
    assert parse_slurm_time(text) == seconds
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1-02:03:04", 93784),
        ("02:03", 123),  # squeue %M prints M:SS for short jobs
        ("0:00", 0),
        ("1:02:03", 3723),
        ("00:01.234", 1),  # sacct TotalCPU has fractions
        ("3-00:00:00", 259200),
        ("5", 300),  # a bare number is minutes in Slurm's own forms
    ],
)
def test_parse_slurm_time(text, seconds):
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize(
    "text", ["UNLIMITED", "INVALID", "NOT_SET", "Partition_Limit", "infinite", "N/A", ""]
)
def test_parse_slurm_time_none_words(text):
    assert parse_slurm_time(text) is None


def test_parse_slurm_time_garbage_is_a_value_error():
    with pytest.raises(ValueError):
        parse_slurm_time("soon")


@pytest.mark.parametrize(
    ("text", "norm"),
    [("16G", "16G"), ("16g", "16G"), ("16GB", "16G"), ("500M", "500M"), ("1.5G", "1536M"), ("2T", "2T")],
)
def test_parse_mem(text, norm):
    assert parse_mem(text) == norm


@pytest.mark.parametrize("text", ["16", "0G", "lots", "16X", "-1G", ""])
def test_parse_mem_refuses(text):
    with pytest.raises(UsageError) as err:
        parse_mem(text)
    assert repr(text) in err.value.message


def test_bare_mem_number_explains_megabytes():
    with pytest.raises(UsageError) as err:
        parse_mem("16")
    assert "megabytes" in err.value.message
    assert "16G" in err.value.hint


def test_mem_megabytes_and_scale():
    assert mem_megabytes("16G") == 16384
    assert mem_megabytes("1T") == 1024 * 1024
    assert mem_megabytes("1536K") == 2
    assert scale_mem("16G", 4) == "64G"
