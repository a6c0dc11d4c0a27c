"""Experiment trackers through Accelerate: ``--log-with tensorboard|wandb|mlflow|...`` (repeatable).

Every metric of a step (the keys of ``metrics.jsonl``) goes to each tracker named, from rank 0 only;
``metrics.jsonl`` is written as before. The names are Accelerate's (``accelerate.tracking``'s
``LOGGER_TYPE_TO_CLASS``); its tracker classes do the writing. We build them ourselves on rank 0
rather than through an ``Accelerator``, which would also take over the wrapping and precision (dist.py
says why rv_train keeps those). They log through Accelerate's logger, which needs its ``PartialState``:
made on rank 0 once the process group exists, it only reads that group (rank, world size, device).

Where each writes. Trackers with local files write under the *tracker folder*: ``RV_OUTPUT_DIR`` when
rv set it (the run's output folder, the same for every segment of a run), else the trainer's output
folder:

* TensorBoard: ``<tracker folder>/tensorboard/<project>/`` (``tensorboard --logdir`` on it);
* W&B: ``<tracker folder>/wandb/``. Compute nodes often have no internet, and an online ``wandb.init``
  there waits for minutes and fails, so W&B runs offline unless ``WANDB_MODE`` says otherwise
  (``WANDB_MODE=online`` to stream). An offline run is uploaded later with
  ``wandb sync <tracker folder>/wandb/offline-run-*``;
* the others: those that Accelerate gives a folder (aim, ...) get ``<tracker folder>/<name>``; the rest
  (mlflow, comet_ml, ...) write wherever their own settings send them (``MLFLOW_TRACKING_URI``, ...).

A resumed run continues the same tracker run: TensorBoard writes into the same folder, with a purge step
so that the steps a killed segment logged after its checkpoint are dropped from view; W&B reuses the run
id kept in the checkpoint (``resume="allow"``). The configuration is stored once, when the tracker run
starts.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def known_trackers() -> tuple[str, ...]:
    """Accelerate's tracker names (imported here only: Accelerate costs about half a second to load)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    return tuple(sorted(LOGGER_TYPE_TO_CLASS))


def check_trackers(names: tuple[str, ...]) -> list[str]:
    """Problems with ``--log-with`` (an unknown name, a missing package), as lines for a usage error.

    Run on every rank before any collective: all ranks see the same installation, so all agree.
    """
    if not names:
        return []
    from accelerate.tracking import get_available_trackers

    known = known_trackers()
    installed = {str(t) for t in get_available_trackers()}
    problems = []
    for name in names:
        if name not in known:
            problems.append(f"--log-with {name}: not one of Accelerate's trackers ({', '.join(known)})")
        elif name not in installed:
            problems.append(f"--log-with {name} needs the {name} package: pip install {name}")
    return problems


class Trackers:
    """The trackers of one run, on rank 0; an empty ``Trackers`` (no names) does nothing."""

    def __init__(self, trackers: list[Any], run_ids: dict[str, str]) -> None:
        self._trackers = trackers
        self.run_ids = run_ids  # kept in the checkpoint, so a resume continues the same tracker run

    @classmethod
    def start(
        cls,
        names: tuple[str, ...],
        *,
        folder: Path,
        project: str,
        config: Mapping[str, Any],
        resume_step: int,
        saved_ids: Mapping[str, str],
        run_name: str | None,
    ) -> Trackers:
        """Start each tracker (rank 0 only). ``resume_step`` > 0: a resume from that step's checkpoint."""
        if not names:
            return cls([], {})
        from accelerate import PartialState
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        PartialState()  # after init_distributed: it takes the existing group, starts none
        trackers, run_ids = [], {}
        for name in dict.fromkeys(names):  # repeated names: one tracker
            kwargs: dict[str, Any] = {}
            tracker_class = LOGGER_TYPE_TO_CLASS[name]
            if name == "tensorboard":
                # SummaryWriter's purge_step: TensorBoard hides the events at or after it from earlier
                # files, i.e. what a killed segment logged after the checkpoint we resume from.
                kwargs = {"purge_step": resume_step + 1} if resume_step else {}
            elif name == "wandb":
                run_ids[name] = saved_ids.get(name) or uuid.uuid4().hex[:8]
                kwargs = {
                    "dir": str(folder),  # W&B adds its own "wandb" folder inside
                    "id": run_ids[name],
                    "resume": "allow",
                    "mode": os.environ.get("WANDB_MODE") or "offline",
                }
                if run_name:
                    kwargs["name"] = run_name
            if tracker_class.requires_logging_directory:
                tracker = tracker_class(project, str(_subfolder(folder, name)), **kwargs)
            else:
                tracker = tracker_class(project, **kwargs)
            tracker.start()
            if not resume_step or (name in run_ids and name not in saved_ids):  # a new tracker run
                tracker.store_init_configuration(_plain_config(config))
            trackers.append(tracker)
        return cls(trackers, run_ids)

    def log(self, metrics: Mapping[str, Any]) -> None:
        values = {k: v for k, v in metrics.items() if k != "step"}
        for tracker in self._trackers:
            tracker.log(values, step=int(metrics["step"]))

    def finish(self) -> None:
        for tracker in self._trackers:
            tracker.finish()
        self._trackers = []


def tracker_folder(output_dir: Path) -> Path:
    """``RV_OUTPUT_DIR`` under rv (every segment of a run shares it), else the trainer's output folder."""
    named = os.environ.get("RV_OUTPUT_DIR")
    return Path(named) if named else output_dir


def _subfolder(folder: Path, name: str) -> Path:
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _plain_config(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The config as the trackers' hyper-parameter tables take it: scalars only (TensorBoard's hparams
    refuse None and lists), so an unset option is "" and a repeated one is joined by commas."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if value is None:
            out[key] = ""
        elif isinstance(value, list | tuple):
            out[key] = ",".join(map(str, value))
        elif isinstance(value, float) and not math.isfinite(value):
            out[key] = str(value)
        else:
            out[key] = value
    return out
