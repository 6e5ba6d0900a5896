"""The short soak (tests/soak/soak.py): 10 seconds of 8 concurrent clients on
`lethe serve` in chain mode (streaming completions of mixed lengths, client
disconnects, chat turns through chains, whole completions, malformed
requests), then every request accounted for in /metrics, no request or KV
slot left behind, RSS within 5% of its value after the warm-up. The long runs
(`make soak`, docs/reliability.md) use the same script."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "soak"))
import soak  # noqa: E402


def test_short_soak(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = soak.main(["--duration", "10", "--clients", "8", "--max-tokens", "6", "--max-prompt-words", "40",
                    "--kv-cache-bytes", "24M", "--max-model-len", "512", "--seed", "3", "--report", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and not r["failures"], r
    assert r["unexpected_errors"] == 0 and r["server_alive"]
    assert r["accepted"] > 0 and r["completed"] > 0
    assert sum(r["finished_by_reason"].values()) == r["accepted"]
    assert r["kv_slots_used_after"] == r["chain_resident_slots_after"]


# build-fuzz/lethe: the server built with ASan + UBSan + LeakSanitizer (make fuzz-build, which
# make test runs first)
LEAK_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                        os.environ.get("LETHE_FUZZ_BUILD", "build-fuzz"), "lethe")


@pytest.mark.skipif(not os.path.exists(LEAK_BIN), reason="needs build-fuzz/lethe (make fuzz-build)")
def test_short_soak_leak_check(tmp_path):
    """The same load on the sanitizer build: after the clean shutdown LeakSanitizer finds no
    allocation left unreachable (request state, events, connection buffers, chains, the
    cancelled and disconnected requests' paths), and ASan / UBSan report nothing."""
    out = tmp_path / "soak.json"
    rc = soak.main(["--duration", "10", "--clients", "6", "--max-tokens", "4", "--max-prompt-words", "20",
                    "--kv-cache-bytes", "24M", "--max-model-len", "512", "--seed", "5", "--report", str(out),
                    "--bin", LEAK_BIN, "--leak-check"])
    r = json.loads(out.read_text())
    assert rc == 0 and not r["failures"], r
    assert r["exit_code"] == 0 and r["sanitizer_reports"] == []
    assert r["accepted"] > 0 and r["completed"] > 0 and r["disconnects"] + r["bad_answered"] > 0
