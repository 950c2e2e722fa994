"""Training progress: a tqdm bar on a terminal, plain log lines everywhere else.

A progress bar written to a file or a pipe (a CI log, ``lowbit train > run.log``) becomes one enormous line of
carriage returns, and ``tqdm`` is an optional dependency (``pip install lowbit[train]``). :class:`Progress` uses
the bar only when tqdm is importable and stdout (and stderr, where tqdm draws) is a terminal; otherwise it prints
one line every ``every`` steps and at the last step.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress", "TQDM_NOTE", "have_tqdm"]

TQDM_NOTE = "[lowbit] note: no progress bar (tqdm is not installed; `pip install lowbit[train]` adds it); " \
            "progress goes to log lines"

_NOTED: list = []  # (TQDM_NOTE printed already)


def have_tqdm() -> bool:
    """Whether ``tqdm`` can be imported."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Progress of a run of ``total`` steps that starts after step ``initial`` (a resumed run).

    ``update(step, **postfix)`` reports that ``step`` steps are done (an absolute count, not an increment) with
    the values in ``postfix`` (e.g. ``loss="2.31"``); ``write(msg)`` prints a message without breaking the bar;
    ``close()`` ends it. ``bar``: ``None`` (auto: tqdm when installed and stdout/stderr are terminals), ``True``
    (tqdm when installed) or ``False`` (log lines). ``every``: steps between log lines (default about ten lines
    per run). ``stream``: where log lines and messages go (default ``sys.stdout``, looked up at each print). ``unit``:
    what a step counts (``lowbit eval`` counts batches).
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "", every: int | None = None, bar: bool | None = None,
                 stream=None, unit: str = "step"):
        self.total, self.desc, self.step, self.unit = int(total), desc, int(initial), unit
        self.every = max(1, int(every) if every else self.total // 10)
        self._stream = stream
        self._t0, self._step0 = time.perf_counter(), self.step
        self._last_logged = self.step
        self._tqdm = None
        self.closed = False
        out = self.stream
        want_bar = (_isatty(out) and _isatty(sys.stderr)) if bar is None else bar
        if want_bar and not have_tqdm():
            if not _NOTED:  # one line per process (lowbit demo runs three), only where a bar was wanted
                _NOTED.append(True)
                print(TQDM_NOTE, file=out, flush=True)
            want_bar = False
        if want_bar:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=self.total, initial=self.step, unit=self.unit, dynamic_ncols=True,
                              desc=desc or None, leave=True, mininterval=0.5)

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stdout

    @property
    def uses_bar(self) -> bool:
        """Whether a tqdm bar is drawn (else: log lines)."""
        return self._tqdm is not None

    def update(self, step: int, **postfix) -> None:
        """``step`` steps are done; ``postfix``: values shown next to the bar or in the log line."""
        step = int(step)
        if self._tqdm is not None:
            if postfix:
                self._tqdm.set_postfix(refresh=False, **postfix)
            self._tqdm.update(step - self.step)
            self.step = step
            return
        self.step = step
        if step - self._last_logged >= self.every or step >= self.total:
            self._last_logged = step
            self._log(postfix)

    def _log(self, postfix: dict) -> None:
        el = time.perf_counter() - self._t0
        rate = (self.step - self._step0) / el if el > 0 else 0.0
        eta = f"  eta {(self.total - self.step) / rate:,.0f} s" if rate > 0 and self.step < self.total else ""
        pct = 100.0 * self.step / self.total if self.total else 100.0
        extra = "".join(f"  {k} {v}" for k, v in postfix.items())
        name = f"{self.desc} " if self.desc else ""
        print(f"[lowbit] {name}{self.unit} {self.step}/{self.total} ({pct:.0f}%){extra}  {el:,.0f} s{eta}",
              file=self.stream, flush=True)

    def write(self, msg: str) -> None:
        """Print ``msg`` on its own line (above the bar, when there is one)."""
        if self._tqdm is not None:
            self._tqdm.write(msg)
        else:
            print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._tqdm is not None:
            self._tqdm.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
