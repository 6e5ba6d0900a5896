"""The dashboard at GET / of `lethe serve`, in headless Chromium (Debian's
`chromium`, driven over the DevTools protocol with websocket-client).

Checked: the page loads with no external request, its header names the
model and method from /metrics; a chat message typed into the playground
streams an answer whose rendered text equals the API's answer to the same
request (greedy); the live panels fill in (KV use per slot space, the
chain's resident vs logical tokens, throughput); a screenshot of the whole
page decodes to a picture of the window's size with the panels' colours;
--no-ui turns the page off; the /metrics series the panels read."""
import re

import pytest
import requests

from chromium import Browser, png_pixels
from lethe_server import Server

W, H = 1400, 900
ARGS = ("--threads", "2", "--max-model-len", "1024", "--sparse-method", "streamingllm",
        "--sparse-config", "sink_keep_tokens=4,recent_keep_tokens=16")


@pytest.fixture(scope="module")
def srv():
    s = Server(*ARGS)
    yield s
    s.stop()


def test_chat_in_the_browser(srv, tmp_path):
    b = Browser(W, H)
    try:
        b.open(srv.url + "/")
        b.wait("document.readyState === 'complete' && document.getElementById('status').textContent === 'live'")
        model = requests.get(srv.url + "/v1/models").json()["data"][0]["id"]
        assert b.js("document.getElementById('model').textContent") == model
        assert b.js("document.getElementById('method').textContent").startswith("streamingllm")
        assert b.js("document.getElementById('pcache').textContent") == "chain"
        # type a message and press Send, greedy, as a user would
        b.js("document.getElementById('temperature').value = '0';"
             "document.getElementById('max_tokens').value = '24';"
             "document.getElementById('input').value = 'Name three colours of the rainbow.';"
             "document.getElementById('send').click(); true")
        b.wait("(document.querySelector('.msg.assistant, .msg.error') || {dataset: {}}).dataset.state === 'done' "
               "|| !!document.querySelector('.msg.error')")
        assert not b.js("!!document.querySelector('.msg.error')"), b.js("document.querySelector('.msg.error').textContent")
        shown = b.js("document.querySelector('.msg.assistant').childNodes[0].nodeValue")
        meta = b.js("document.querySelector('.msg.assistant .meta').textContent")
        ref = requests.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "max_tokens": 24, "temperature": 0}).json()
        assert shown == ref["choices"][0]["message"]["content"] and shown
        assert meta.startswith("finish " + ref["choices"][0]["finish_reason"]) and "chain_" in meta
        # a second turn continues the chain the first one created
        b.js("document.getElementById('input').value = 'And three more?';"
             "document.getElementById('send').click(); true")
        b.wait("document.querySelectorAll('.msg.assistant').length === 2 && "
               "document.querySelectorAll('.msg.assistant')[1].dataset.state === 'done'")
        meta2 = b.js("document.querySelectorAll('.msg.assistant')[1].querySelector('.meta').textContent")
        m = re.search(r"cached (\d+)", meta2)
        assert m and int(m.group(1)) > 0, meta2  # the chain's resident KV was reused
        # the panels: per-layer KV spaces, the chains table, throughput history
        b.wait("document.getElementById('kv_total').textContent.includes('30 spaces')")
        b.wait("document.querySelectorAll('#chains tr').length >= 3")
        row = b.js("[...document.querySelectorAll('#chains tr')].slice(1).map(r => [...r.cells].map(c => "
                   "c.textContent))")
        assert any(int(r[2]) > int(r[3]) > 0 for r in row), row  # logical > resident: streamingllm evicted
        b.wait("document.getElementById('s_gen').textContent !== '-'")
        shot = b.screenshot()
        (tmp_path / "dashboard.png").write_bytes(shot)
        w, h, colours = png_pixels(shot)
        assert (w, h) == (W, H)
        assert len(colours) > 50  # text, charts and bars, not a blank page
        assert (79, 179, 255) in {tuple(c) for c in colours}  # the KV / chain bars' blue (--used)
        # nothing outside the server was requested
        assert b.requests and all(u.startswith(srv.url) for u in b.requests), b.requests
    finally:
        b.close()


def test_metrics_series_and_no_ui(srv):
    text = requests.get(srv.url + "/metrics").text
    info = re.search(r'^lethe:engine_info\{(.*)\} 1$', text, re.M).group(1)
    assert 'method="streamingllm"' in info and 'prefix_cache="chain"' in info and 'device="cpu"' in info
    spaces = re.findall(r'^lethe:kv_space_total_slots\{.*space="(\d+)"\} (\S+)$', text, re.M)
    assert [int(s) for s, _ in spaces] == list(range(30)) and all(float(v) > 0 for _, v in spaces)
    sel = float(re.search(r'^lethe:attention_selected_slots_total\{.*\} (\S+)$', text, re.M).group(1))
    res = float(re.search(r'^lethe:attention_resident_slots_total\{.*\} (\S+)$', text, re.M).group(1))
    ev = float(re.search(r'^lethe:sparse_evicted_slots_total\{.*\} (\S+)$', text, re.M).group(1))
    assert 0 < sel <= res and ev > 0
    chains = re.findall(r'^lethe:chain_logical_tokens\{.*chain="([^"]+)"\} (\S+)$', text, re.M)
    assert chains and all(len(c) == 14 for c, _ in chains)  # a prefix of the id, never the whole id
    assert requests.get(srv.url + "/").headers["content-type"].startswith("text/html")
    s = Server("--threads", "2", "--max-model-len", "256", "--no-ui")
    try:
        r = requests.get(s.url + "/")
        assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
        text = requests.get(s.url + "/metrics").text  # radix mode: one shared slot space
        assert re.findall(r'^lethe:kv_space_total_slots\{.*space="(\d+)"\}', text, re.M) == ["0"]
        assert 'prefix_cache="radix"' in text
    finally:
        s.stop()
