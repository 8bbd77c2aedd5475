"""What a watch measured, built into its diagnosis once the steps are over (rcnn.doctor.watching.Watch
inherits it): the table, the why rows, env.json, the printout and the files ``save`` writes."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import pandas as pd

from rcnn.doctor.columns import COMPILED, EAGER_AFTER_LIMIT, compiled_against_eager
from rcnn.doctor.compiled import compiled_tables, kernel_tables
from rcnn.doctor.files import DOCTOR_FILES, NO_REPORT, doctor_files, write_run
from rcnn.doctor.verdict import Diagnosis, middle_half, tabulate
from rcnn.measure.device import DTYPES
from rcnn.measure.machine import copy_peak, fingerprint, matmul_paths
from rcnn.measure.settings import machine_name
from rcnn.outputs import claim_folder
from rcnn.rules import UserError, ValueNotAllowed

MEASURED = "measured"  # peak_tflops: measure the matmul peak for the dtype the steps computed in
MOST_INPUTS = 5  # distinct call descriptions env.json keeps


class NothingWatched(UserError):
    """A watch that measured no step: the model ran no backward inside the block, only forwards under
    no_grad, or fewer steps than warm-up takes. Its message says which."""


class NothingWatchedWarning(UserWarning):
    """Issued where a ``with watch(...)`` block ends without a measured step."""


class WatchResults:
    """The results half of a Watch: it reads the state the Watch's measuring half keeps."""

    def _nothing(self) -> str | None:
        """Why nothing was measured, or None."""
        if self._tables:
            return None
        name = type(self._eager).__name__
        seen = self._steps
        if not seen.grad_forwards and seen.no_grad_forwards:
            return (
                f"watch: {name} ran forward only under torch.no_grad or inference_mode "
                f"({seen.no_grad_forwards} calls): no graph, no backward, nothing to time; watch it in a "
                "training loop, where its loss runs backward"
            )
        if not seen.grad_forwards:
            return (
                f"watch: {name} ran no forward inside the block: nothing to time; run its training loop in it"
            )
        if not seen.ended:
            return (
                f"watch: {name} ran {seen.grad_forwards} forwards and no backward of their graph inside "
                "the block: nothing to time (a backward through torch.autograd.grad, or in another thread, "
                "is not seen; mark each step with `with w.step():`)"
            )
        return (
            f"watch: {name} ran {seen.ended} steps inside the block, all of them the FLOP-counting one "
            f"and warm-up ({len(self._warm)}): nothing timed; run more steps inside the block"
        )

    def _dtype(self) -> str:
        if self._amp and self._amp != "off":
            return self._amp
        weight = next((p for p in self._eager.parameters() if p.is_floating_point()), None)
        names = {dtype: name for name, dtype in DTYPES.items()}
        return names.get(weight.dtype, "fp32") if weight is not None else "fp32"

    def _build(self) -> tuple[Diagnosis, dict]:
        dtype = self._dtype()
        peak, paths = self.peak_tflops, {}
        if peak == MEASURED:
            paths = matmul_paths(self.device, DTYPES[dtype])
            peak = max(paths.values())
        copy_gbps = copy_peak(self.device) if self.explain else None  # what the why rows set bytes against
        timer, tables, flop_table = self._timer, self._tables, self._flops
        ran = self._profile.ran if self._profiled else None
        trace = self._profile.trace if self._profiled else None
        compiled_said, words = {}, {}
        if self._compiled is not None:  # compiled modules' rows: their kernels'; FLOPs: the eager step's
            compiled = self._compiled
            timer, names = self._flop_timer, list(self._flop_timer.types)
            kept = middle_half(self._totals["backward_ms"])  # the steps the table averages
            _, kernels_ran, words = kernel_tables(compiled.times(kept), len(kept), names)
            # what a compiled module's backward ran: its kernels (the profiled step saw its region's call)
            ran = {m: r for m, r in (ran or {}).items() if not compiled.covers(m)} | kernels_ran
            own = [kernel_tables(times, 1, names)[0] for times in compiled.step_times]
            tables = compiled_tables(self._tables, own, names, self._calls, compiled.names)
            covered = [name for name in flop_table.index if compiled.covers(name)]
            flop_table = flop_table.copy()
            flop_table.loc[covered, "backward_moved_mb"] = math.nan  # eager ops' bytes, not its kernels'
            trace, compiled_said = trace or compiled.trace, compiled.summary(kept, names)
        diagnosis = tabulate(
            self._eager,
            timer,
            tables,
            self._totals,
            flop_table,
            peak_tflops=peak,
            copy_gbps=copy_gbps,
            explain=self.explain,
            device=self.device,
            precision_met=self.policy.precision_met([self._totals["backward_ms"]]),
            cores_used=self._cores.record(),
            deadline=self.policy.deadline,
            ran=ran,
            timings=self.timings,
            trace=trace,
            extra=compiled_said
            | {
                "warmup_cut": self._warmup_cut,
                "warmup_steps": len(self._warm),
                "dtype": dtype,
                "amp": self._amp or "off",
                "forwards_per_step": max(f for f, _ in self._per_step),
                "backwards_per_step": max(b for _, b in self._per_step),
                "distributed": self._ranks is not None,
            },
        )
        if self._compiled is not None:
            limited = compiled_said["recompile_limited"]
            for region, functions in limited.items():  # said in the row that holds their time
                said = f"{EAGER_AFTER_LIMIT} {', '.join(functions)}"
                words[region] = f"{said}; {words[region]}" if words.get(region) else said
            diagnosis.modules[COMPILED] = diagnosis.modules["module"].map(words).fillna("")
        if self._view is not None:  # rank 0 of a DDP model: every rank's rows, and the ranks' view
            peak_said = diagnosis.summary["peak_tflops"]
            by_rank = self._view.by_module(diagnosis.modules, peak_said)
            diagnosis = dataclasses.replace(diagnosis, ranks=self._view, by_rank=by_rank)
        env = {
            "fingerprint": fingerprint(self.device),
            "ceilings": {
                "matmul_tflops": {dtype: diagnosis.summary["peak_tflops"]},
                "matmul_paths": {dtype: paths},
                "copy_gbps": copy_gbps,
            },
            "model": f"{type(self._eager).__module__}.{type(self._eager).__qualname__}",
            "inputs": self._inputs,
            "amp": self._amp or "off",
            "dtype": dtype,
            "channels_last": self._layout,
            "summary": diagnosis.summary,
            **({"ranks": self._view.summary} if self._view is not None else {}),
        }
        return diagnosis, env

    def _built(self) -> tuple[Diagnosis, dict]:
        if not self.detached:
            raise NothingWatched(
                f"watch: {self.measured} of {self.steps or 'the policy'}'s steps timed so far; read it after "
                "the block ends, or once it detached (w.detached)"
            )
        if problem := self._nothing():
            raise NothingWatched(problem)
        if self._result is None:
            self._result = self._build()
        return self._result

    @property
    def diagnosis(self) -> Diagnosis:
        """The by-module table, the why rows and the summary (built once, after the block or the last step:
        the flags' timings and the why rows run then). Raises NothingWatched without a timed step."""
        return self._built()[0]

    @property
    def env(self) -> dict:
        """What env.json holds: the machine's fingerprint, the matmul peak, the inputs seen, amp, summary."""
        return self._built()[1]

    def table(self) -> pd.DataFrame:
        """The by-module table (modules.csv): rcnn.doctor.columns.MODULE_COLUMNS; on rank 0 of a DDP model
        every rank's rows, with a ``rank`` column after ``module`` (rcnn.doctor.ranks.RanksView.by_module)."""
        diagnosis = self.diagnosis
        return diagnosis.by_rank if diagnosis.by_rank is not None else diagnosis.modules

    @property
    def ranks(self) -> pd.DataFrame | None:
        """On rank 0 of a DDP model, per rank its step split (ranks.csv: rcnn.doctor.ranks.RANK_COLUMNS);
        None elsewhere."""
        return self.diagnosis.ranks.table if self._view is not None else None

    def compare(self, other: WatchResults) -> pd.DataFrame:
        """This watch's table beside ``other``'s, one of them of the model compiled and the other eager (the
        same model, watched in the same loop): each module's forward and backward ms per step either way and
        compiled / eager (rcnn.doctor.columns.compiled_against_eager)."""
        if (self._compiled is None) == (other._compiled is None):
            kind = "compiled" if self._compiled is not None else "eager"
            raise ValueNotAllowed(
                "compare",
                f"both watches are of {kind} models; allowed: one of the model compiled (whole or in part), "
                "one eager",
            )
        eager, compiled = (other, self) if self._compiled is not None else (self, other)
        return compiled_against_eager(eager.table(), compiled.table())

    def report(self, top: int = 15) -> str:
        """What ``print(w)`` prints: the command's printout of this diagnosis."""
        if not self.detached:
            return f"watch: {self.measured} of {self.steps or 'the policy'}'s steps timed so far"
        if problem := self._nothing():
            return problem
        return self.diagnosis.report(top, self._title())

    def _title(self) -> str:
        env = self.env
        where = machine_name(env["fingerprint"])
        # the first step's call; a loop whose batches vary (the boxes of each image) says how many more it saw
        inputs = self._inputs[0] if self._inputs else "no tensors"
        if len(self._inputs) > 1:
            more = f"{len(self._inputs) - 1}{'+' if len(self._inputs) >= MOST_INPUTS else ''}"
            inputs += f" (and {more} other shapes of call, in env.json)"
        layout = ", channels_last" if self._layout else ""
        compiled = ""
        if self._compiled is not None:
            parts = "" if self._compiled.whole else ", ".join(self._compiled.names) + " compiled: "
            compiled = f" ({parts}torch.compile, Inductor)"
        wrapped = compiled
        if self._ranks is not None:
            wrapped = f" (DistributedDataParallel, rank {self._ranks.rank} of {self._ranks.world})"
        return (
            f"{type(self._eager).__name__}{wrapped} on {self.device.type} ({where}), in its own loop: "
            f"{inputs}, {env['dtype']}{layout}"
        )

    def __str__(self) -> str:
        return self.report()

    def save(self, folder: str | Path, *, own: bool = False) -> list[Path]:
        """Write modules.csv, why.csv, env.json, trace.json (the profiled step's torch.profiler trace, its
        backward ops in their modules' ranges: rcnn.doctor.trace) and report.html (where plotly is installed)
        into ``folder``:
        absent, empty, or one the doctor wrote (its files are replaced). Raises NothingWatched, writing
        nothing, without a timed step, and rcnn.outputs.OutputError for a folder holding other files. Returns
        the paths written.

        Under DDP, rank 0 writes every rank's rows in modules.csv and ranks.csv; another rank writes nothing
        (returns []) unless ``own``: then its own diagnosis, as one process would."""
        if self._ranks is not None and not self._ranks.leads and not own:
            return []
        diagnosis, env = self._built()
        folder = Path(folder)
        old = claim_folder(folder, DOCTOR_FILES, what="save")
        texts = doctor_files(diagnosis, env, title=self._title())
        if "report.html" not in texts:
            warnings.warn(f"report.html not written: {NO_REPORT}", stacklevel=2)
        return write_run(folder, texts, old)
