#!/usr/bin/env python3
"""scripts/dashboard_screenshot.py [OUT.png] - the dashboard of `lethe serve`
under load, as a PNG (docs/dashboard.png).

Starts `lethe serve` on the default model with streamingllm (evictions, the
Chain Cache), runs multi-turn chat clients that continue their chains in
the background, sends one message through the page's playground in headless
Chromium, and takes the screenshot while the clients run. Needs a build
($LETHE_BUILD, default build/), chromium and websocket-client
(scripts/setup.sh)."""
import os
import sys
import threading
import time

import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from chromium import Browser  # noqa: E402
from lethe_server import Server  # noqa: E402

TOPICS = ["the sea", "mountains", "the moon", "trains", "bread", "rivers", "owls", "glass"]


def client(url, topic, stop):
    """One conversation: each turn continues the chain the first created."""
    msgs, chain = [], None
    while not stop.is_set():
        try:
            chain = turn(url, topic, msgs, chain)
        except requests.RequestException:  # the server stops under a running turn
            return
        if len(msgs) > 8:
            msgs.clear()
            chain = None


def turn(url, topic, msgs, chain):
    """One turn: appends the question and the answer to msgs; the chain id to continue."""
    msgs.append({"role": "user", "content": f"Tell me one more thing about {topic}."})
    body = {"messages": msgs, "max_tokens": 48, "temperature": 0.8}
    if chain:
        body["chain_id"] = chain
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=600).json()
    if "error" in r:  # a reclaimed chain: start over
        msgs.clear()
        return None
    msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return r.get("chain_id")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "dashboard.png")
    srv = Server("--threads", "2", "--max-model-len", "2048", "--sparse-method", "streamingllm",
                 "--sparse-config", "sink_keep_tokens=4,recent_keep_tokens=64", "--kv-cache-bytes", "112M")
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(srv.url, t, stop), daemon=True) for t in TOPICS[:6]]
    b = None
    try:
        for t in threads:
            t.start()
        b = Browser(1280, 800)
        b.open(srv.url + "/")
        b.wait("(document.getElementById('status') || {}).textContent === 'live'")
        b.js("document.getElementById('max_tokens').value = '64';"
             "document.getElementById('input').value = 'What does a sparse KV cache keep?';"
             "document.getElementById('send').click(); true")
        b.wait("(document.querySelector('.msg.assistant') || {dataset: {}}).dataset.state === 'done'", timeout=600)
        time.sleep(20)  # a window of the panels' history under load
        with open(out, "wb") as f:
            f.write(b.screenshot())
        print(f"wrote {out}")
    finally:
        stop.set()
        if b:
            b.close()
        srv.stop()


if __name__ == "__main__":
    main()
