"""scripts/gpu-check.sh packs its $OUT into results.tgz (+ summary.txt) on exit:
the device machine hands back at most 8 files, and a run leaves dozens."""
import io
import os
import subprocess
import tarfile

from lethe_server import ROOT


def _run(out, *args, env=None):
    e = dict(os.environ, OUT=str(out), **(env or {}))
    return subprocess.run(["bash", "scripts/gpu-check.sh", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=60)


def _fill(out):
    out.mkdir()
    for i in range(20):
        (out / f"run{i}.log").write_text(f"log {i}\n")
    (out / "quality").mkdir()
    (out / "quality" / "snapkv-grid-x-h200.json").write_text("{}")
    (out / "summary.txt").write_text("== summary\n")


def test_pack_leaves_results_and_summary(tmp_path):
    out = tmp_path / "out"
    _fill(out)
    r = _run(out, "pack", env={"PACK": "1"})
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["results.tgz", "summary.txt"]
    assert (out / "summary.txt").read_text() == "== summary\n"
    with tarfile.open(out / "results.tgz") as t:
        names = {os.path.normpath(n) for n in t.getnames()}
        assert {f"run{i}.log" for i in range(20)} <= names
        assert "quality/snapkv-grid-x-h200.json" in names
        assert t.extractfile("./run7.log").read() == b"log 7\n"


def test_large_output_is_split_into_parts(tmp_path):
    out = tmp_path / "out"
    _fill(out)
    (out / "big.bin").write_bytes(os.urandom(17 << 20))  # does not compress
    r = _run(out, "pack", env={"PACK": "1"})
    assert r.returncode == 0, r.stderr
    parts = sorted(n for n in os.listdir(out) if n.startswith("results.tgz."))
    assert len(parts) == 2 and all(os.path.getsize(out / p) <= 15 << 20 for p in parts)
    blob = b"".join((out / p).read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as t:
        assert len(t.extractfile("./big.bin").read()) == 17 << 20


def test_no_pack_inside_the_checkout_by_default(tmp_path):
    out = os.path.join(ROOT, "gpu-out-packtest")
    try:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "a.log"), "w").write("a\n")
        r = _run(out, "pack")
        assert r.returncode == 0, r.stderr
        assert os.listdir(out) == ["a.log"]
    finally:
        subprocess.run(["rm", "-rf", out])
