"""OpenTelemetry for every rlfleet process: the SDK's providers and exporters (set up once per process), and
reading file exports back. Nothing here runs per call or per step.

Instrumented code uses the OTel API itself: a module's tracer (``trace.get_tracer("rlfleet")``) and its metric
instruments (``metrics.get_meter("rlfleet").create_histogram(...)``), made once at import; OTel's proxy tracer and
meter bind them to the providers :func:`setup` installs, and until then they are no-ops, so in-process tests and
tools pay nothing. The per-call trace context is the interceptors': the channels' (:mod:`rlfleet.wire.channels`)
inject W3C ``traceparent`` into every call's metadata and the servers' (:mod:`rlfleet.wire.servers`) run each call in
a SERVER span named by the method, child of the caller's context. Servers, channels and the objects that make
per-step spans decide once, when they are built, whether they trace (:func:`enabled`; ``telemetry.step_spans`` for
the per-env-step and per-act-batch spans).

One trace per training epoch: the coordinator's ``epoch`` span holds ``collect`` (one per env server) and
``train``; trace context rides in the gRPC metadata, so the env server's Collect (``env.step`` and ``act`` spans per
step, ``push_rollout``), the inference server's ``act_batch`` spans (linked to each rollout they serve), the
learner's PushRollout and Train (``ppo_update``, ``publish_weights``) and the inference server's UpdateWeights are
children in the same trace. Metrics (env steps, act batch sizes, queue waits, latency histograms) go through the
OTel metrics API.

``telemetry.traces`` picks the exporter: ``file`` writes ``<run>/traces/{spans,metrics}_<role>_<index>.jsonl``
(one JSON object per line: OTel's own span/metrics JSON), ``otlp`` sends to ``telemetry.otlp_endpoint`` (or
$OTEL_EXPORTER_OTLP_ENDPOINT) over gRPC, ``none`` turns both off.
"""

from __future__ import annotations

import os
import pathlib

from opentelemetry import metrics, trace

TRACE_DIR_ENV = "RLFLEET_TRACE_DIR"  # where file exports go (set by launchers; default <config dir>/traces)

_state = {"enabled": False, "providers": [], "step_spans": False}


def enabled(*, step_spans: bool = False) -> bool:
    """Whether :func:`setup` installed the exporters here (``step_spans=True``: and ``telemetry.step_spans`` asks for
    the fine-grained spans too). Asked once, when a server, channel or span-making object is built; never per call."""
    return _state["enabled"] and (_state["step_spans"] or not step_spans)


def setup(role: str, index: int, cfg, run_dir: str | os.PathLike | None = None) -> str:
    """Install tracer and meter providers for this process from ``cfg.telemetry``; returns where they export
    ('' when off). ``run_dir``: where file exports go unless $RLFLEET_TRACE_DIR says otherwise."""
    mode = cfg.telemetry.traces
    if mode == "none":
        return ""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create(
        {
            "service.name": f"rlfleet-{role}",
            "service.instance.id": f"{role}-{index}",
            "rlfleet.experiment": str(cfg.runner.experiment_name),
        }
    )
    interval = int(cfg.telemetry.metrics_interval_s * 1000)
    if mode == "otlp":
        endpoint = cfg.telemetry.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            raise SystemExit(
                "config error: 'telemetry.traces' is otlp but neither telemetry.otlp_endpoint nor "
                "OTEL_EXPORTER_OTLP_ENDPOINT is set"
            )
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
        metric_exporter = OTLPMetricExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
        where = f"OTLP {endpoint}"
    else:
        base = os.environ.get(TRACE_DIR_ENV) or (pathlib.Path(run_dir) / "traces" if run_dir else None)
        if base is None:
            return ""
        base = pathlib.Path(base)
        base.mkdir(parents=True, exist_ok=True)
        spans = open(base / f"spans_{role}_{index}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
        metric_file = open(base / f"metrics_{role}_{index}.jsonl", "a", buffering=1)  # noqa: SIM115
        span_exporter = ConsoleSpanExporter(out=spans, formatter=lambda s: s.to_json(indent=None) + "\n")
        metric_exporter = ConsoleMetricExporter(out=metric_file, formatter=lambda m: m.to_json(indent=None) + "\n")
        where = str(base)
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=500))
    meter_provider = MeterProvider(
        resource=resource,
        metric_readers=[PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval)],
    )
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(meter_provider)
    _state.update(enabled=True, step_spans=bool(cfg.telemetry.step_spans), providers=[provider, meter_provider])
    return where


def shutdown() -> None:
    """Flush and stop the exporters (services leave with os._exit, which skips atexit)."""
    for p in _state["providers"]:
        try:
            p.shutdown()
        except Exception:  # noqa: BLE001 - telemetry never fails a process
            pass
    _state["providers"] = []


# --- reading file exports back (coordinatorctl traces, tests) ----------------------------------------------------
def load_spans(run_dir: str | os.PathLike) -> list[dict]:
    """Every span of a run's file export (``<run>/traces/spans_*.jsonl``), as OTel's JSON objects."""
    from rlfleet.untrusted import json_lines

    out = []
    for path in sorted(pathlib.Path(run_dir, "traces").glob("spans_*.jsonl")):
        if path.is_file() and not path.is_symlink():
            out.extend(json_lines(path))  # line by line; a line cut short by a kill is skipped
    return out


def epoch_trace(spans: list[dict], epoch: int) -> list[dict]:
    """The spans of the trace whose root is the coordinator's span for ``epoch``."""
    roots = [s for s in spans if s["name"] == "epoch" and s["attributes"].get("rlfleet.epoch") == epoch]
    if not roots:
        return []
    trace_id = roots[-1]["context"]["trace_id"]
    return [s for s in spans if s["context"]["trace_id"] == trace_id]


def format_tree(trace_spans: list[dict], max_children: int = 6) -> str:
    """An indented tree: span name, service, duration; long runs of same-named children are summarised."""
    from datetime import datetime

    def dur(s):
        t = [datetime.fromisoformat(s[k].replace("Z", "+00:00")) for k in ("start_time", "end_time")]
        return (t[1] - t[0]).total_seconds() * 1000

    children: dict[str | None, list[dict]] = {}
    ids = {s["context"]["span_id"] for s in trace_spans}
    for s in sorted(trace_spans, key=lambda s: s["start_time"]):
        parent = s["parent_id"] if s["parent_id"] in ids else None
        children.setdefault(parent, []).append(s)
    lines: list[str] = []

    def walk(parent, depth):
        kids = children.get(parent, [])
        by_name: dict[str, list[dict]] = {}
        for k in kids:
            by_name.setdefault(k["name"], []).append(k)
        for k in kids:
            same = by_name[k["name"]]
            if len(same) > max_children and k is not same[0]:
                continue
            service = k["resource"]["attributes"].get("service.instance.id", "?")
            if len(same) > max_children:
                total = sum(dur(x) for x in same)
                lines.append(f"{'  ' * depth}{k['name']} x{len(same)} [{service}] {total:.1f} ms total")
                continue
            lines.append(f"{'  ' * depth}{k['name']} [{service}] {dur(k):.1f} ms")
            walk(k["context"]["span_id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)
