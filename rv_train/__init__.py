"""rv_train: a small GRPO trainer for DDP and FSDP under torchrun (CPU/gloo or GPU/NCCL).

It runs on the cluster, in the job's environment; of ``rv`` it imports only :mod:`rv.contract`
(standard library only: the RV_* names, the stop protocol and the precision rule both sides follow),
never the CLI or its dependencies. Entry points: ``python -m rv_train`` and
``examples/grpo/train.py``; see :mod:`rv_train.trainer`.

Exit codes (the trainer's own; rv passes the remote code through):

====  ===========================================================================
code  meaning
====  ===========================================================================
0     finished; or stopped on a signal after saving (then ``PREEMPTED`` is in the checkpoint folder)
1     an unexpected error (traceback on stderr)
2     bad command line
3     circuit breaker: the mean reward was 0 for ``--breaker-steps`` steps in a row (saved first)
4     ``--max-nonfinite-steps`` steps in a row were skipped: non-finite loss, logits or gradients
====  ===========================================================================
"""

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_ZERO_REWARD = 3
EXIT_NON_FINITE = 4
