"""`pagedllm bench isolation` against a live server: it measures the watcher idle and under each
attack and reports what the attacks were answered (shape only: timing is the machine's)."""

from __future__ import annotations

import json

from pagedllm.cli import main
from tests.server.conftest import RunningServer, tiny_config


def test_the_isolation_bench_reports_every_attack(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "isolation.json"
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=64)) as server:
        # The big request (64 prompts x n=4) must end within its window to report its status:
        # few tokens and 4 s, so it does on a machine running other tests beside this one.
        code = main(["bench", "isolation", "--base-url", server.base_url, "--idle-s", "1",
                     "--attack-s", "4", "--watch-tokens", "24", "--attack-tokens", "8",
                     "--attacks", "big,logit-bias,sse,grammar", "--output-json", str(out)])
    assert code == 0
    rows = {row["attack"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == ["idle", "big", "logit-bias", "sse", "grammar"]
    for row in rows.values():
        assert row["gaps"] > 0 and row["tiny_status"] == 200
    assert rows["big"]["attack_statuses"] == [200]
    assert rows["logit-bias"]["attack_statuses"] == [400]  # past the bound: refused, cheaply
    assert 503 in rows["sse"]["attack_statuses"]  # past the readers' limit
    assert rows["grammar"]["attack_statuses"] == [400]  # its masks' product refused at compile
    assert "tiny request 200" in capsys.readouterr().out
