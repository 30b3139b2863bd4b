"""The Markdown tables of benchmarks/inference_cpu.sh's outputs: python benchmarks/inference_table.py OUT_DIR"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys

from gpt2lab.observe.plot import md_table


def _read(out: pathlib.Path) -> dict:
    return {
        p.stem: json.loads(p.read_text().strip().splitlines()[-1])
        for p in sorted(out.glob("*.json"))
        if p.read_text().strip()
    }


def _held(run: dict) -> str:
    return f"{run['inference']['dtype']}/{run['inference']['kernel']}"


def _floats(figures: dict) -> dict:
    """The figures that were measured (not a peer's error text)."""
    return {k: v for k, v in figures.items() if isinstance(v, float)}


def sample_tables(runs: dict) -> None:
    if auto := runs.get("sample-auto"):
        t, ct = auto["tok_per_s"], _floats(auto.get("ctranslate2_tok_per_s", {}))
        print(
            f"Default (`{_held(auto)}`): **{t['sample']:.1f}** tok/s; "
            f"`generate()` {t['generate']:.1f}; unprepared under autocast {t['unprepared']:.1f}; "
            f"transformers {t.get('transformers', 0):.1f}; "
            + "; ".join(f"CTranslate2 {k} {v:.1f}" for k, v in ct.items())
            + "\n"
        )
    for name in ("sample-settings", "sample-int8"):
        if r := runs.get(name):
            t = r["tok_per_s"]
            rows = [[f"default ({_held(r)})" if way == "sample" else way, v] for way, v in t.items() if v]
            rows += [[f"CTranslate2 {k}", v] for k, v in _floats(r.get("ctranslate2_tok_per_s", {})).items()]
            head = [f"{name}: way", f"tok/s (best of {len(r['seconds']['sample'])})", "vs the default"]
            print("\n".join(md_table([head, *([w, f"{v:.1f}", f"{v / t['sample']:.2f}x"] for w, v in rows)])) + "\n")


def serve_table(runs: dict) -> None:
    by: dict[str, list[dict]] = {}
    for name, r in runs.items():
        if m := re.fullmatch(r"serve-(.+)-r(\d+)", name):
            by.setdefault(m.group(1), []).append(r)
    if not by:
        return
    head = ["`bench serve` setting", "held as", "1 stream tok/s (median; runs)", "8 streams tok/s (median; runs)"]
    rows = []
    for setting, rs in by.items():
        vals = [[next(x["aggregate_tok_per_s"] for x in r["load"] if x["streams"] == n) for r in rs] for n in (1, 8)]
        cells = [f"**{statistics.median(v):.1f}** ({', '.join(f'{x:.0f}' for x in v)})" for v in vals]
        rows.append([setting, ", ".join(sorted({_held(r) for r in rs})), *cells])
        for r in rs:
            ct2 = {c["rows"]: c["aggregate_tok_per_s"] for c in r.get("ctranslate2", [])}
            for kind in ("float32", "int8", "bfloat16"):
                if all(isinstance(ct2.get(n, {}).get(kind), float) for n in (1, 8)):
                    cells = [f"{ct2[n][kind]:.1f}" for n in (1, 8)]
                    rows.append([f"CTranslate2 {kind}: a 1-row and an 8-row batch", "", *cells])
    print("\n".join(md_table([head, *rows])))


def main() -> None:
    runs = _read(pathlib.Path(sys.argv[1]))
    sample_tables(runs)
    serve_table(runs)


if __name__ == "__main__":
    main()
