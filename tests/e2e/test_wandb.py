"""Weights & Biases logging in WANDB_MODE=offline: the run files W&B writes hold the same
records as metrics.jsonl, a resumed run continues the same W&B run, and a missing package
or a failed login costs one line while metrics.jsonl is written as always."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY

from gpt2lab.distributed.dist import DistInfo
from gpt2lab.observe.metrics import MetricsLogger
from gpt2lab.train.settings import load_preset


def wandb_records(path: Path) -> list:
    """Records of a .wandb file: W&B's 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks: crc32c, length, type full/first/middle/last), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def finished_records(run_dir: Path, timeout: float = 60.0) -> list:
    """The records of a run's .wandb file once W&B's writer (its own process, asynchronous) has
    written the run's exit record; on a loaded machine that can come after wandb.finish returns."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(run_dir.glob("*.wandb"))
        records = wandb_records(files[0]) if files else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history(records: list) -> list[dict]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="W&B tests need the wandb package (wandb extra)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # never the user's settings
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    yield
    wandb.teardown()  # W&B keeps its settings in a process-wide singleton: the next test reads the env afresh


def test_offline_run_files_hold_the_metrics_and_a_resume_continues_the_run(offline, tiny_data, tmp_path):
    from gpt2lab.train.run import train

    out = tmp_path / "run"
    fields = {
        **TINY,
        "data": tiny_data,
        "out": str(out),
        "eval_interval": 2,
        "eval_tokens": 128,
        "sample_interval": 2,
        "sample_tokens": 6,
        "ckpt_interval": 2,
        "wandb_project": "gpt2lab-test",
    }
    train(load_preset("shakespeare-cpu", **{**fields, "max_steps": 2}), DistInfo(device=torch.device("cpu")))
    train(
        load_preset("shakespeare-cpu", **{**fields, "max_steps": 4}),
        DistInfo(device=torch.device("cpu")),
        resume="auto",
    )
    run_id = (out / "wandb_id").read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith("-" + run_id) for r in runs)  # one W&B run, resumed
    records = [rec for r in runs for rec in finished_records(r)]
    logged = history(records)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in metrics if "train_loss" in m} == {0, 1, 2, 3}
    for m in metrics:  # every record, train and val alike, with its own step and values
        want = {k: v for k, v in m.items() if k != "sample" and v is not None}
        assert any(all(h.get(k) == v for k, v in want.items()) for h in logged), m
    tables = [h["samples/path"] for h in logged if "samples/path" in h]  # a table is logged as a file
    last = json.loads((runs[-1] / "files" / tables[-1]).read_text())
    assert last["columns"] == ["step", "sample"]
    assert last["data"] == [[m["step"], m["sample"]] for m in metrics if "sample" in m]  # 0, 2 and 4
    config = {
        i.key: json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "run"
        for i in r.run.config.update
    }
    assert config["model"]["n_layer"] == 2 and config["logging"]["wandb_project"] == "gpt2lab-test"
    assert config["optim"]["max_steps"] in (2, 4)  # the run's config.json, nested by section


def test_missing_package_is_one_line_and_local_logging_goes_on(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False, wandb_project="p")
    log.log({"step": 0, "val_loss": 3.5})
    log.close()
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "gpt2lab: W&B logging off: the wandb package is not installed (pip install 'gpt2lab[wandb]'); "
        "metrics.jsonl is written as always"
    ]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "val_loss": 3.5}


def test_failed_login_is_one_line_and_local_logging_goes_on(tmp_path, monkeypatch, capfd):
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # settings made by an earlier test in this process are not this test's
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no stored key
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, progress=False, wandb_project="p")
    log.log({"step": 0, "train_loss": 9.0, "lr": 1e-3, "grad_norm": 1.0, "dt_ms": 5.0, "tok_per_s": 1.0, "mfu": None})
    log.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if "W&B" in line]
    assert len(lines) == 1 and lines[0].startswith("gpt2lab: W&B logging off: ")
    assert not (tmp_path / "wandb_id").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["train_loss"] == 9.0
