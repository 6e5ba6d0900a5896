"""docs/serving.md's table of request fields beyond OpenAI's and `lethe serve
--help` name the same fields (so a field added to one is added to both)."""
import os
import re
import subprocess

from lethe_server import BIN, ROOT


def test_help_lists_every_documented_extension_field():
    doc = open(os.path.join(ROOT, "docs", "serving.md")).read()
    table = doc.split("### Request fields beyond OpenAI's", 1)[1].split("\n\n", 3)[2]
    fields = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        fields.update(re.findall(r"`([a-z_]+)", first))
    assert {"top_k", "chain_id", "chain_append_start", "forced_token_ids", "response_format"} <= fields, fields
    out = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    head = out.split("options:", 1)[0]
    missing = sorted(f for f in fields if not re.search(rf"\b{f}\b", head))
    assert not missing, f"lethe serve --help does not list {missing}"
    assert "--no-ui" in out
