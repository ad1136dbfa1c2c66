"""OpenTelemetry for every rlfleet process: traces and metrics, exported to OTLP or to JSON-lines files.

One trace per training epoch: the coordinator's ``epoch`` span holds ``collect`` (one per env server) and
``train``; trace context rides in the gRPC metadata (W3C ``traceparent``, added by :mod:`rlfleet.wire.rpc`'s
interceptors), so the env server's Collect (``env.step`` and ``act`` spans per step, ``push_rollout``), the
learner's PushRollout and Train (``ppo_update``, ``publish_weights``) and the inference server's UpdateWeights
are children in the same trace. Metrics (env steps, act batch sizes, queue waits, latency histograms) go through
the OTel metrics API.

``telemetry.traces`` picks the exporter: ``file`` writes ``<run>/traces/{spans,metrics}_<role>_<index>.jsonl``
(one JSON object per line: OTel's own span/metrics JSON), ``otlp`` sends to ``telemetry.otlp_endpoint`` (or
$OTEL_EXPORTER_OTLP_ENDPOINT) over gRPC, ``none`` turns both off. Until :func:`setup` runs, every call here is a
no-op (OTel's API default), so in-process tests and tools pay nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import pathlib
import threading

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace

TRACE_DIR_ENV = "RLFLEET_TRACE_DIR"  # where file exports go (set by launchers; default <config dir>/traces)

_state = {"enabled": False, "providers": [], "step_spans": False}
_lock = threading.Lock()
_instruments: dict[str, object] = {}


def tracer():
    return trace.get_tracer("rlfleet")


def enabled() -> bool:
    return _state["enabled"]


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

    resource = Resource.create({"service.name": f"rlfleet-{role}", "service.instance.id": f"{role}-{index}",
                                "rlfleet.experiment": str(cfg.runner.experiment_name)})
    interval = int(cfg.telemetry.metrics_interval_s * 1000)
    if mode == "otlp":
        endpoint = cfg.telemetry.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            raise SystemExit("config error: 'telemetry.traces' is otlp but neither telemetry.otlp_endpoint nor "
                             "OTEL_EXPORTER_OTLP_ENDPOINT is set")
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
    meter_provider = MeterProvider(resource=resource, metric_readers=[
        PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval)])
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(meter_provider)
    with _lock:
        _state["enabled"] = True
        _state["step_spans"] = bool(cfg.telemetry.step_spans)
        _state["providers"] = [provider, meter_provider]
        _instruments.clear()
    return where


def shutdown() -> None:
    """Flush and stop the exporters (services leave with os._exit, which skips atexit)."""
    for p in _state["providers"]:
        try:
            p.shutdown()
        except Exception:  # noqa: BLE001 - telemetry never fails a process
            pass
    _state["providers"] = []


def span(name: str, **attributes):
    """A span as the current one: ``with tracing.span("collect", epoch=3): ...`` (no-op when off)."""
    return tracer().start_as_current_span(name, attributes={k: v for k, v in attributes.items() if v is not None})


def step_span(name: str, parents: list[dict] | None = None, **attributes):
    """A fine-grained span (one env step, one act batch): only with ``telemetry.step_spans``. ``parents``: trace
    contexts carried in messages (an act batch serves several rollouts): the first is the parent, every one a
    link."""
    if not _state["step_spans"]:
        return contextlib.nullcontext()
    if not parents:
        return span(name, **attributes)
    contexts = [propagate.extract(p) for p in parents if p]
    links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts]
    return tracer().start_as_current_span(name, context=contexts[0] if contexts else None, links=links,
                                          attributes={k: v for k, v in attributes.items() if v is not None})


def inject() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (empty when off or outside a span)."""
    if not _state["enabled"]:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def submit(pool, fn, *args, **kwargs):
    """``pool.submit`` that carries the caller's trace context into the worker thread."""
    return pool.submit(contextvars.copy_context().run, fn, *args, **kwargs)


# --- metrics ---------------------------------------------------------------------------------------------------
def _instrument(kind: str, name: str, unit: str, description: str):
    key = f"{kind}:{name}"
    inst = _instruments.get(key)
    if inst is None:
        meter = metrics.get_meter("rlfleet")
        make = {"counter": meter.create_counter, "histogram": meter.create_histogram}[kind]
        inst = _instruments[key] = make(name, unit=unit, description=description)
    return inst


def count(name: str, value: float, unit: str = "1", description: str = "", **attributes) -> None:
    if _state["enabled"]:
        _instrument("counter", name, unit, description).add(value, attributes)


def record(name: str, value: float, unit: str = "1", description: str = "", **attributes) -> None:
    if _state["enabled"]:
        _instrument("histogram", name, unit, description).record(value, attributes)


# --- server side: one span per RPC, child of the caller's context ------------------------------------------------
def _wrap(behavior, method: str, response_streaming: bool):
    def extract(context):
        return propagate.extract({k: v for k, v in context.invocation_metadata()})

    if response_streaming:
        def stream_behavior(request, context):
            token = otel_context.attach(extract(context))
            try:
                with tracer().start_as_current_span(method, kind=trace.SpanKind.SERVER):
                    yield from behavior(request, context)
            finally:
                otel_context.detach(token)
        return stream_behavior

    def unary_behavior(request, context):
        token = otel_context.attach(extract(context))
        try:
            with tracer().start_as_current_span(method, kind=trace.SpanKind.SERVER):
                return behavior(request, context)
        finally:
            otel_context.detach(token)
    return unary_behavior


class ServerInterceptor(grpc.ServerInterceptor):
    """Starts a server span per call (named by the method, e.g. 'rlfleet.v1.LearnerService/Train')."""

    def intercept_service(self, continuation, handler_call_details):
        import grpc

        handler = continuation(handler_call_details)
        if handler is None or not _state["enabled"] or handler_call_details.method.startswith("/grpc."):
            return handler
        method = handler_call_details.method.lstrip("/")
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, method, True),
                                                         handler.request_deserializer, handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, method, False),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, method, True),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, method, False),
                                                   handler.request_deserializer, handler.response_serializer)


# --- reading file exports back (coordinatorctl traces, tests) ----------------------------------------------------
def load_spans(run_dir: str | os.PathLike) -> list[dict]:
    """Every span of a run's file export (``<run>/traces/spans_*.jsonl``), as OTel's JSON objects."""
    import json

    out = []
    for path in sorted(pathlib.Path(run_dir, "traces").glob("spans_*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a kill
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
