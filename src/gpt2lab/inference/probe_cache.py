"""The inference probe's cache: one bounded, versioned JSON file in gpt2lab's cache directory
(``$GPT2LAB_CACHE``, else ``~/.cache/gpt2lab``), ``decode-probes.json``. Read, written, listed and
removed here only: inference/probe.py writes the figures it measures, ``for_inference(dtype="auto")``
reads them (never writes), ``gpt2lab env`` lists them and ``gpt2lab env --clear-cache`` removes the file.

One entry per machine, device, model shape and candidate set (no workload: the dtype those figures
decide is every workload's): each candidate's reference figures (a ``REQUEST_TOKENS``-token prefill
and a one-row step, ms, or why it was dropped), the server's ``--max-batch``-row step figures under
``rows``, what each workload chose from them under ``choices``, and when each was measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Optional

from gpt2lab.inference.choice import REQUEST_TOKENS, Timing
from gpt2lab.inference.kernels import compiled_build
from gpt2lab.system import env, formats, runtime
from gpt2lab.system.files import write_json

PROBE_FILE = "decode-probes.json"
# Past this many entries the oldest written goes (a day of tests builds dozens of shapes).
PROBE_ENTRIES = 32
SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")  # what env shows of a model


def path() -> str:
    return os.path.join(env.cache_dir(), PROBE_FILE)


def key(config, device, names: list[str]) -> str:
    """The entry of a model (its GPTConfig) on ``device`` of this machine and this build of the compiled
    kernel, for these candidates."""
    parts = [
        runtime.machine_key(),
        compiled_build(),
        str(device),
        json.dumps(dataclasses.asdict(config), sort_keys=True),
        ",".join(sorted(names)),
        str(REQUEST_TOKENS),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def entries(where: Optional[str] = None) -> dict:
    """The file's entries ({key: entry}); {} if absent, unreadable or of another format version."""
    try:
        with open(where or path()) as fh:
            data = json.load(fh)
        found = data.get("entries", {}) if formats.is_current(data, formats.PROBES, key="version") else {}
        return {k: v for k, v in found.items() if isinstance(v, dict)} if isinstance(found, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _figures(raw) -> Optional[dict]:
    try:
        return {k: Timing(**v) if isinstance(v, dict) else str(v) for k, v in raw.items()}
    except (TypeError, AttributeError):
        return None


def timings(entry: Optional[dict]) -> Optional[dict]:
    """An entry's reference figures: candidate name -> Timing, or -> why it was dropped; None if it has none."""
    return _figures(entry.get("timings")) if entry else None


def rows_timings(entry: Optional[dict], rows: int) -> Optional[dict]:
    """An entry's ``rows``-row step figures (name -> ms, or why dropped); None if not measured."""
    found = ((entry or {}).get("rows") or {}).get(str(rows))
    if not isinstance(found, dict) or not isinstance(found.get("timings"), dict):
        return None
    return {k: (float(v) if isinstance(v, (int, float)) else str(v)) for k, v in found["timings"].items()}


def _written(entry: dict) -> float:
    w = entry.get("written")
    return float(w) if isinstance(w, (int, float)) else 0.0


def _jsonable(figures: dict) -> dict:
    return {k: dataclasses.asdict(v) if isinstance(v, Timing) else v for k, v in figures.items()}


def update(k: str, change, where: Optional[str] = None) -> None:
    """Apply ``change(entry)`` (an entry dict, {} when new) to entry ``k`` and write the file atomically (the
    oldest entries go past PROBE_ENTRIES). A read-only cache is no harm: the probe runs again next time."""
    where = where or path()
    found = entries(where)
    entry = found.get(k, {})
    change(entry)
    found[k] = entry
    keep = sorted(found, key=lambda n: _written(found[n]))
    found = {n: found[n] for n in keep[-PROBE_ENTRIES:]}
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        write_json(where, {"version": formats.PROBES.version, "entries": found}, indent=None)
    except OSError:
        pass


def save_timings(k: str, config, device, figures: dict) -> None:
    """The reference figures of entry ``k`` (its rows figures and choices, of other figures, go)."""

    def change(entry: dict) -> None:
        entry.clear()
        entry.update(
            written=time.time(),
            model={f: getattr(config, f) for f in SHAPE},
            device=str(device),
            timings=_jsonable(figures),
        )

    update(k, change)


def save_rows(k: str, rows: int, figures: dict) -> None:
    def change(entry: dict) -> None:
        entry.setdefault("rows", {})[str(rows)] = {"written": time.time(), "timings": figures}
        if isinstance(entry.get("not_kept"), dict):
            entry["not_kept"].pop("rows", None)

    update(k, change)


def note_not_kept(k: str, config, device, doubts: list[str], rows: Optional[int] = None) -> None:
    """Why the figures just measured for entry ``k`` (``rows``: its ``rows``-row step figures) were not kept
    (inference/probe.py's doubts), for ``gpt2lab env``; figures kept before stay, and are used."""

    def change(entry: dict) -> None:
        if not entry:
            entry.update(written=time.time(), model={f: getattr(config, f) for f in SHAPE}, device=str(device))
        notes = entry["not_kept"] = entry.get("not_kept") if isinstance(entry.get("not_kept"), dict) else {}
        notes["rows" if rows else "reference"] = {"written": time.time(), "why": doubts}

    update(k, change)


def note_choice(k: str, label: str, name: str) -> None:
    """Record what ``label`` (a workload) chose from entry ``k``'s figures, if that changed (for ``env``)."""
    found = entries().get(k)
    if found is None or (found.get("choices") or {}).get(label) == name:
        return
    update(k, lambda entry: entry.setdefault("choices", {}).__setitem__(label, name))


def drop(k: str) -> bool:
    """Remove entry ``k`` (its figures are measured again next time); whether it was there."""
    where = path()
    found = entries(where)
    if k not in found:
        return False
    del found[k]
    try:
        write_json(where, {"version": formats.PROBES.version, "entries": found}, indent=None)
    except OSError:
        return False
    return True


def clear() -> Optional[str]:
    """Remove the probe cache file (nothing else); its path if there was one."""
    where = path()
    try:
        os.remove(where)
    except FileNotFoundError:
        return None
    return where


def entry_lines(entry: dict) -> list[str]:
    """An entry as lines for ``gpt2lab env``: the model's shape and device, when measured, what each
    workload chose, each candidate's figures (or why it was dropped), and why figures measured on a busy
    machine were not kept."""
    shape = entry.get("model") or {}
    stamp = _stamp(entry)
    head = (
        f"{shape.get('n_layer', '?')} layers, {shape.get('n_head', '?')} heads, {shape.get('n_embd', '?')} wide, "
        f"vocabulary {shape.get('vocab_size', '?')}, block {shape.get('block_size', '?')} on "
        f"{entry.get('device', '?')}, measured {stamp}"
    )
    lines = [head]
    choices = entry.get("choices") or {}
    if choices:
        lines.append("chose: " + ", ".join(f"{w} {c}" for w, c in sorted(choices.items())))
    for name, t in (timings(entry) or {}).items():
        if isinstance(t, Timing):
            tiles = f", its tiles up to {t.tile_rows} rows" if t.tile_rows else ""
            lines.append(f"{name}: prefill {t.prefill:.3g} ms, one-row step {t.step1:.3g} ms{tiles}")
        else:
            lines.append(f"{name}: {t}")
    for rows, found in sorted((entry.get("rows") or {}).items()):
        figs = rows_timings(entry, int(rows)) or {}
        text = ", ".join(f"{n} {v:.3g} ms" if isinstance(v, float) else f"{n} {v}" for n, v in figs.items())
        lines.append(f"{rows}-row step (serve): {text}")
    for what, note in sorted((entry.get("not_kept") or {}).items()):  # a machine too busy to measure on
        why = note.get("why") if isinstance(note, dict) else None
        why = "; ".join(map(str, why)) if isinstance(why, list) else "?"
        lines.append(f"not kept ({what} figures, {_stamp(note)}: the machine was busy): {why}")
    return lines


def _stamp(found) -> str:
    when = found.get("written") if isinstance(found, dict) else None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"
