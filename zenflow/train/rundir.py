"""One run's hold on its directory: locked for the whole run, never reused by accident.

``RunDirectory(spec)`` (the spec after ``merge_resumed_spec`` when resuming):

- ``claim()``, before the slow setup: an existing ``run_dir`` that is not a zfctl run
  (``runs.holds_run``: by its config.json, never by file names) and is not empty (someone
  else's files, e.g. a Hugging Face model folder) is refused before anything is written
  in it, ``--overwrite`` or not; an existing directory (``resume``, or a ``run_dir``) is
  then locked for this process (``runs.RunDirLock``), and one that already holds a run is
  refused unless resuming or ``overwrite`` -- so a second process, or a typo in
  ``--run-dir``, fails at once and touches nothing.
- ``create(task)``, after setup: a new directory (under ``runs_root``, or a ``run_dir``
  that did not exist) is made and locked only now, so a setup error (model, data,
  ``--seq-len``) leaves no empty run directory behind; ``overwrite`` removes the old run's
  files there (``runs.clear_run``: ours only, also inside checkpoints/ and model/; what it
  kept is said in ``notes``, which the run header shows). ``--overwrite`` with an empty or
  new folder has nothing to remove and simply starts the run there.
- ``reopen(metrics_lines, step, total_steps)`` for a resumed run: metrics.jsonl cut back
  to the lines its checkpoint counted, summary.json removed (no longer true).
- ``finished_summary(total_steps)``: the summary of a resumed run with nothing left to do.
  A resumed run whose lock cannot be made because the folder cannot be written (a
  read-only file system, no permission) is not refused at ``claim``: a finished run needs
  no write and says so; any other raises the lock's error here, before anything is written.
- ``release()``: drop the lock (the kernel also drops it when the process dies).
"""

from __future__ import annotations

import errno
from pathlib import Path

from zenflow.errors import StorageError, UserInputError
from zenflow.train import runs

# Why a lock file cannot be made in a folder that is there: it cannot be written.
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunDirectory:
    def __init__(self, spec):
        self.spec = spec
        self.path: Path | None = None
        self._lock: runs.RunDirLock | None = None
        self._unwritable: StorageError | None = None  # resume: the lock could not be made
        self.notes: list[str] = []  # for the run header: what --overwrite kept

    def claim(self) -> None:
        spec = self.spec
        if spec.resume:
            self.path = Path(spec.run_dir)
            try:
                self._take(self.path)
            except StorageError as exc:  # decided once the run's length is known
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and cause.errno in _CANNOT_WRITE):
                    raise
                self._unwritable = exc
        elif spec.run_dir is not None and Path(spec.run_dir).is_dir():
            self.path = Path(spec.run_dir)
            self._refuse_foreign_folder()  # before the lock file is made in it
            self._take(self.path)
            self._refuse_existing_run()

    def create(self, task: str) -> Path:
        spec = self.spec
        if spec.run_dir is None:
            root = Path(spec.runs_root)
            with runs.writing(root, "cannot create a run directory under"):
                self.path = runs.create_run_dir(root, spec.model, task)
            self._take(self.path)
            return self.path
        self.path = Path(spec.run_dir)
        if self._lock is None:  # it did not exist at claim time
            with runs.writing(self.path, "cannot create the run directory"):
                self.path.mkdir(parents=True, exist_ok=True)
            self._refuse_foreign_folder()  # made by someone else since claim()
            self._take(self.path)
            self._refuse_existing_run()
        if spec.overwrite and runs.holds_run(self.path):  # an empty folder: nothing to remove
            kept: list[str] = []
            runs.clear_run(self.path, kept)
            if kept:
                shown = ", ".join(kept[:8]) + (
                    f", ... ({len(kept)} in all)" if len(kept) > 8 else ""
                )
                self.notes.append(
                    f"--overwrite removed the old run's files and kept {len(kept)} that zfctl "
                    f"did not write: {shown}"
                )
        return self.path

    def reopen(self, metrics_lines: int, step: int, total_steps: int) -> list[dict]:
        """Lines written after the checkpoint belong to steps that run again, and so does
        the final evaluation of a run stopped during its final save (``step`` reached
        ``total_steps``). Returns the metrics records kept."""
        kept = runs.trim_metrics(
            self.path / runs.METRICS_FILE,
            metrics_lines,
            drop_eval_at=step if step >= total_steps else None,
        )
        summary = self.path / runs.SUMMARY_FILE
        with runs.writing(summary, "cannot remove"):
            summary.unlink(missing_ok=True)
        return kept

    def finished_summary(self, total_steps: int) -> dict | None:
        """The summary of a resumed run that already did everything asked of it (finished,
        its final checkpoint, model and summary written), else None."""
        if not self.spec.resume:
            return None
        summary = runs.read_json(self.path / runs.SUMMARY_FILE)
        final = runs.checkpoint_step(runs.latest_checkpoint(self.path))
        if (
            isinstance(summary, dict)
            and summary.get("status") == "finished"
            and summary.get("steps") == total_steps == final
            and (self.path / runs.MODEL_DIR).is_dir()
        ):  # its folder as this session names it (the saved one may be relative elsewhere)
            return {**summary, "run_dir": str(self.path)}
        if self._unwritable is not None:  # there is work to do, and it cannot be written
            raise self._unwritable
        return None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _take(self, path: Path) -> None:
        self._lock = runs.RunDirLock(path).acquire()

    def _refuse_foreign_folder(self) -> None:
        """A folder that is not a zfctl run is used only when empty: zfctl never writes a
        run among, nor deletes, files it did not write."""
        if runs.holds_run(self.path):
            return
        foreign = runs.foreign_entries(self.path)
        if not foreign:
            return
        shown = ", ".join(foreign[:6]) + (", ..." if len(foreign) > 6 else "")
        done = (
            "--overwrite deletes only a zfctl run's files, so nothing was removed"
            if self.spec.overwrite
            else "nothing was written there"
        )
        raise UserInputError(
            f"--run-dir {self.path} is not a zfctl run ({runs.not_a_run_reason(self.path)}) "
            f"and is not empty (it holds {shown}): zfctl writes a run only into an empty or "
            f"new folder, and {done}. Choose an empty or new folder for --run-dir."
        )

    def _refuse_existing_run(self) -> None:
        if not self.spec.overwrite and runs.holds_run(self.path):
            raise UserInputError(
                f"--run-dir {self.path} already holds a run. Continue it with --resume "
                f"{self.path}, or pass --overwrite to delete the files zfctl wrote there "
                f"({', '.join(runs.OUR_ENTRIES)}; your other files stay) and start a new "
                "run there, or choose another --run-dir."
            )
