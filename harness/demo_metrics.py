"""The demo's summary numbers from the served apps' ``/metrics`` (where the time goes per token:
prefill, draft, verify, overhead), settled after the chat requests, and its picture
(``summary.png``).
"""

from __future__ import annotations

import time
from pathlib import Path

from harness.demo_console import DemoError, say
from harness.demo_processes import http_get

_TOTALS = {"prefill_s": "prefill_seconds_total", "draft_s": "draft_seconds_sum", "verify_s": "verify_seconds_sum",
           "tokens": "generated_tokens_total", "cycles": "engine_cycles_total", "acc_sum": "accepted_length_sum",
           "acc_count": "accepted_length_count"}


def app_metrics(url: str) -> dict:
    """Totals over an app's replicas from its /metrics."""
    from serve_app.metrics import scrape_totals

    code, text = http_get(url + "/metrics", timeout=30)
    if code != 200:
        raise DemoError(f"{url}/metrics answered {code}")
    t = scrape_totals(text)
    return {k: t.get(name, 0.0) for k, name in _TOTALS.items()} | {
        "draft_tokens": t["draft_tokens_total"], "accepted_draft_tokens": t["accepted_draft_tokens_total"],
        # an app serving the target alone labels its drafter gauge with empty strings: no drafter
        "drafter": t["drafter_info"] if t["drafter_info"] and any(t["drafter_info"].values()) else None}


def settled_metrics(url: str, tokens: float, timeout: float = 60.0) -> dict:
    """``app_metrics`` once the app's totals count at least ``tokens`` generated tokens:
    replicas push their metrics every ``metrics_push_s``, and a loaded machine can take
    longer than that, so a fixed sleep would read totals that miss the last requests."""
    deadline = time.monotonic() + timeout
    while True:
        m = app_metrics(url)
        if m["tokens"] >= tokens or time.monotonic() > deadline:
            if m["tokens"] < tokens:
                say(f"  warning: {url}/metrics still counts {m['tokens']:.0f} of {tokens:.0f} tokens after {timeout:.0f} s")
            return m
        time.sleep(0.5)


def metrics_delta(a: dict, b: dict) -> dict:
    """What the requests between two /metrics readings added (totals and the drafted counts)."""
    d = {k: b[k] - a[k] for k in _TOTALS}
    for k in ("draft_tokens", "accepted_draft_tokens"):
        d[k] = {s: b[k][s] - a[k].get(s, 0.0) for s in b[k]}
    d["tau"] = d["acc_sum"] / d["acc_count"] if d["acc_count"] else None
    d["drafter"] = b["drafter"]
    return d


def plot_summary(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = s["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["AR (target alone)", "speculative"]
    rates = [r["ar"]["tokens_per_s"], r["speculative"]["tokens_per_s"]]
    a1.bar(names, rates, color=["#999999", "#2a7ab9"])
    for i, v in enumerate(rates):
        a1.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    a1.set_ylabel("output tokens/s over HTTP")
    tau = r["speculative"]["tau"]
    a1.set_title(f"{r['speedup']:.2f}x AR" + (f", tau {tau:.2f}" if tau else "") + f", {s['chat']['requests']} requests")
    bottom = [0.0, 0.0]
    for part, color in (("prefill", "#cccccc"), ("draft", "#f28e2b"), ("verify", "#4e79a7"), ("overhead", "#e15759")):
        vals = [r["ar"]["ms_per_token"][part], r["speculative"]["ms_per_token"][part]]
        a2.bar(names, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_ylabel("ms per generated token")
    a2.set_title("where the time goes")
    a2.legend()
    fig.suptitle(f"{s['model']}: served drafter {(s['serving']['drafter'] or {}).get('version') or ''} vs AR")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
