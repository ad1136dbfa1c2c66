"""VLLMDecoder: the ``rollout.backend: vllm`` inference backend (no gRPC), an optional implementation of
services.inference.backend's ``InferenceBackend``. vLLM's engine decodes the action tokens of token-decoding VLAs
(``openvla``); rlfleet's policy code does the rest.

One thread owns vLLM's engine (vLLM is not thread-safe) and runs a loop:
- an Act request is admitted as soon as it arrives: the policy embeds its rows' prompts (vision backbone,
  projector, token embeddings; the value head on the prompt's last hidden state when the policy has a critic),
  and every row becomes one vLLM request (prompt embeddings in, ``D`` action tokens out, sampling restricted to
  the 256 action ids, log-probs of the sampled tokens renormalised over those ids: ``processed_logprobs``). vLLM's
  scheduler batches the rows of every stream together, continuously: rows that arrive mid-decode join the next
  engine step (our dynamic batcher is not used).
- a weights update waits for the rows in flight to finish (a row is decoded by one weights version from its
  first token to its last), then reloads vLLM's language model in place from the policy copy that now holds the
  new version (tensors in memory, no files), then admits the requests that arrived meanwhile.
- a reload that fails leaves vLLM's model in an unknown state (vLLM reloads layer by layer): the engine is
  discarded and rebuilt from the new weights. An engine step that fails is survived the same way: a new engine from
  the weights being served, and the rows in flight decoded again from their first token.
- when a rebuild fails too, the engine is lost: the inference server exits (``on_fatal``), the launcher or the
  container platform restarts it and the coordinator has the learner publish the weights to it again, the run
  going on (the path a kill -9 of an inference server takes). Without ``on_fatal`` (tests), the update fails and
  Act requests get UNAVAILABLE until an update succeeds.

Sampling noise: a row with a noise key (rlfleet.wire.codec) is sampled with vLLM's per-request seed derived from it, so
its tokens do not depend on what it was batched with; vLLM's sampler is not rlfleet's, so the numbers differ from
the ``hf`` backend's for the same key.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from opentelemetry import metrics

from rlfleet.errors import Unavailable
from rlfleet.policies.models.actor_critic import to_torch_obs
from services.inference.backend import ActRequest, BackendStats, InferenceBackend

log = logging.getLogger("rlfleet.inference.vllm")
_FORWARD_LATENCY = metrics.get_meter("rlfleet").create_histogram(
    "rlfleet.inference.forward_latency", "s", "one act request, admitted to decoded (vllm)"
)

# vLLM's defaults that matter on a shared CPU host, unless the user set them: the engine runs in this process
# (no engine-core child to lose), a KV cache of 1 GiB (tiny and 7B prompts of ~300 tokens fit many rows), and no
# OpenMP thread binding (the env servers and the learner share these cores), warnings and errors only.
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@dataclass
class _Pending:
    """An Act request whose rows are being decoded."""

    request: ActRequest
    policy: object  # the policy copy whose weights decode it
    version: int
    rows: int
    values: torch.Tensor | None
    prompt_inputs: dict
    t_admit: float
    tokens: dict[int, list[int]] = field(default_factory=dict)
    log_probs: dict[int, list[float]] = field(default_factory=dict)


@dataclass
class _Update:
    policy: object
    version: int
    done: Future


def write_serving_dir(policy, path: pathlib.Path) -> pathlib.Path:
    """The folder vLLM builds its engine from: the language model's config (Llama, with the out-of-tree
    architecture name) and its weights under rlfleet's checkpoint names (``llm.*``, mapped by the model class)."""
    from safetensors.torch import save_file

    from rlfleet.policies.models.openvla.vllm_model import ARCHITECTURE

    path.mkdir(parents=True, exist_ok=True)
    cfg = policy.llm.config.to_dict()
    cfg.update(architectures=[ARCHITECTURE], dtype="float32", torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(
        {f"llm.{k}": v.detach().float().contiguous().clone() for k, v in base_lm_state(policy).items()},
        str(path / "model.safetensors"),
    )
    return path


def base_lm_state(policy) -> dict[str, torch.Tensor]:
    """The language model's tensors in transformers' Llama names; with LoRA the frozen base weights only (peft's
    ``base_layer`` wrappers unwrapped, the adapters left out: vLLM serves those as a LoRA adapter)."""
    if not policy.is_lora:
        return dict(policy.llm.state_dict())
    state = policy.llm.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


def write_adapter_dir(policy, path: pathlib.Path) -> pathlib.Path:
    """The policy's LoRA adapters in peft's layout (adapter_config.json + adapter_model.safetensors), which vLLM's
    LoRA support loads."""
    path.mkdir(parents=True, exist_ok=True)
    policy.llm.save_pretrained(str(path))
    return path


class VLLMDecoder(InferenceBackend):
    name = "vllm"

    def __init__(self, *, max_num_seqs: int = 256, seed: int = 0, workdir: str | None = None, on_fatal=None):
        super().__init__(on_fatal)
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="rlfleet-vllm-"))
        self.llm = None
        self.policy = None
        self.version = -1
        self.engine_builds = 0
        self.reloads = 0
        self.failed_reloads = 0
        self.engine_builds_after_failure = 0  # engines rebuilt after a step failed
        self.down: str | None = None  # why Act is refused (the engine could not be rebuilt), or None
        # on_fatal (InferenceBackend): called with the reason when the engine is lost and cannot be rebuilt; the
        # inference server exits then, so that it is restarted and gets the weights again (None: stay up, refuse
        # Act, rebuild at the next update)
        # fault injection (tests, drills): the next N reloads break off half-way and raise, as a transfer cut off
        # mid-update would; RLFLEET_FAULT_VLLM_RELOAD_FAILURES=N sets it for a whole run
        self.fail_next_reloads = int(os.environ.get("RLFLEET_FAULT_VLLM_RELOAD_FAILURES", "0") or 0)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.lora_request = None  # the adapter of the served version (LoRA policies), passed with every row
        self._adapters = 0  # adapters loaded so far: each gets the next id
        self.requests_served = 0
        self.rows_run = 0
        self.steps_run = 0

    # --- called from other threads ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="vllm-decoder", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, request: ActRequest) -> None:
        if self.down:
            raise Unavailable(f"vLLM engine is down ({self.down}); waiting for a weights update to rebuild it")
        self._queue.put(request)
        self.requests_served += 1

    def stats(self) -> BackendStats:
        """Engine steps, and the rows decoded over them (each row takes one step per action token)."""
        tokens = self.policy.num_action_tokens if self.policy is not None else 0
        return BackendStats(self.requests_served, self.steps_run, self.rows_run * tokens)

    def set_weights(self, policy, version: int, timeout: float = 900.0) -> None:
        """Serve ``policy`` (holding weights ``version``) from now on: rows in flight finish on the old weights,
        vLLM's language model is reloaded (or the engine built, the first time), later rows use the new ones."""
        done: Future = Future()
        self._queue.put(_Update(policy, version, done))
        done.result(timeout)

    # --- the loop (the only thread that touches vLLM) ------------------------------------------------------------
    def _loop(self) -> None:
        deferred: list = []  # requests that arrived after a pending update: admitted once it is applied
        update: _Update | None = None
        while True:
            items = [self._queue.get()] if not self._pending and update is None else []
            while True:  # everything queued now
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    self._fail_all(deferred, Unavailable("inference server stopping"))
                    if update is not None:
                        update.done.set_exception(Unavailable("inference server stopping"))
                    return
                if isinstance(item, _Update):
                    if update is not None:  # superseded: the newer weights serve its callers too
                        update.done.set_result(None)
                    update = item
                elif update is not None:
                    deferred.append(item)
                else:
                    self._admit(item)
            if update is not None and not self._pending:
                self._apply(update)
                update = None
                for request in deferred:
                    self._admit(request)
                deferred = []
            if self._pending:
                self._step()

    def _fail_all(self, requests, exc) -> None:
        for r in requests:
            r.future.set_exception(exc)
        for p in self._pending.values():
            if not p.request.future.done():
                p.request.future.set_exception(exc)
        self._pending.clear()

    def _apply(self, update: _Update) -> None:
        failed = None
        if self.llm is not None:
            try:
                self._reload(update.policy)
            except Exception as exc:  # noqa: BLE001 - vLLM's model is half loaded: rebuild it
                failed = f"{type(exc).__name__}: {exc}"
        if failed is not None:  # (outside the except block: its traceback would keep the old engine alive)
            self.failed_reloads += 1
            log.warning("vLLM weight reload for version %d failed (%s); rebuilding the engine", update.version, failed)
            self._discard()
        if self.llm is None:
            try:
                self._build(update.policy)
            except Exception as exc:  # noqa: BLE001 - reported to the learner; Act refused until an update works
                log.error("vLLM engine could not be built for weights version %d: %s", update.version, exc)
                update.done.set_exception(Unavailable(f"vLLM engine could not be built: {exc}"))
                self._discard()
                self._lost(f"engine build failed: {type(exc).__name__}: {exc}")
                return
        self.policy, self.version, self.down = update.policy, update.version, None
        update.done.set_result(None)

    def _build(self, policy) -> None:
        from vllm import LLM

        from rlfleet.policies.models.openvla.vllm_model import register

        register()
        t0 = time.monotonic()
        folder = write_serving_dir(policy, self.workdir / f"engine-{self.engine_builds}")
        max_len = int(policy.llm.config.max_position_embeddings)
        lora = {}
        if policy.is_lora:
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(policy))
        self.llm = LLM(
            model=str(folder),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_len,
            max_num_seqs=self.max_num_seqs,
            # whole prompts only: a chunked prefill discards a sampled token, which vLLM's seeded
            # CPU generators cannot rewind ("CPU Generator does not use offset")
            enable_chunked_prefill=False,
            max_num_batched_tokens=max_len * min(self.max_num_seqs, 64),
            logprobs_mode="processed_logprobs",
            max_logprobs=1,
            enable_prompt_embeds=True,
            seed=self.seed,
            **lora,
        )
        shutil.rmtree(folder, ignore_errors=True)  # the weights live in the engine now
        self.engine_builds += 1
        self.lora_request = None
        if policy.is_lora:
            self._load_adapter(policy)
        log.info(
            "vLLM engine built in %.1f s (%d-token context, up to %d sequences)",
            time.monotonic() - t0,
            max_len,
            self.max_num_seqs,
        )

    def _load_adapter(self, policy) -> None:
        """Serve the policy's current LoRA adapters: a new adapter id per version (vLLM caches adapters by id),
        the previous one removed."""
        from vllm.lora.request import LoRARequest

        self._adapters += 1
        folder = write_adapter_dir(policy, self.workdir / f"adapter-{self._adapters}")
        old, self.lora_request = (
            self.lora_request,
            LoRARequest(f"rlfleet-{self._adapters}", self._adapters, str(folder)),
        )
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _reload(self, policy) -> None:
        if policy.is_lora:  # the base weights are frozen: only the adapters change
            if self.fail_next_reloads > 0:
                self.fail_next_reloads -= 1
                raise RuntimeError("injected weight reload failure")
            self._load_adapter(policy)
            self.reloads += 1
            return
        weights = [(f"llm.{k}", v.detach()) for k, v in base_lm_state(policy).items()]
        if self.fail_next_reloads > 0:
            self.fail_next_reloads -= 1

            def broken():  # the first half of the model, then an error: as a transfer cut off mid-way
                yield from weights[: len(weights) // 2]
                raise RuntimeError("injected weight reload failure")

            source = broken()
        else:
            source = iter(weights)
        t0 = time.monotonic()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": source})
        self.reloads += 1
        log.debug("vLLM weights reloaded in %.3f s", time.monotonic() - t0)

    def _discard(self) -> None:
        """Shut the engine down and release vLLM's process-wide state (its parallel groups), so that a new
        engine can be built in this process."""
        import gc

        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # noqa: BLE001 - a dead engine may fail to shut down; it is dropped anyway
                log.debug("vLLM engine shutdown: %s", exc)
            del llm
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()

    def _admit(self, request) -> None:
        from vllm import SamplingParams

        if self.llm is None:
            request.future.set_exception(Unavailable(f"vLLM engine is down ({self.down or 'no weights yet'})"))
            return
        policy, rid = self.policy, f"r{next(self._ids)}"
        try:
            with torch.inference_mode():
                obs = to_torch_obs(request.obs)
                rows, values, prompt_inputs = policy.prompt_embeddings(obs, request.instructions)
            allowed = policy.action_token_ids
            keys = request.noise_keys
            self._pending[rid] = _Pending(
                request, policy, self.version, len(rows), values, prompt_inputs, time.monotonic()
            )
            for i, emb in enumerate(rows):
                params = SamplingParams(
                    n=1,
                    max_tokens=policy.num_action_tokens,
                    min_tokens=policy.num_action_tokens,
                    ignore_eos=True,
                    temperature=0.0 if request.deterministic else policy.temperature,
                    allowed_token_ids=allowed,
                    logprobs=0,
                    detokenize=False,
                    seed=None if keys is None or request.deterministic else int(keys[i]) % (2**63),
                )
                self.llm.llm_engine.add_request(
                    f"{rid}:{i}", {"prompt_embeds": emb.float().clone()}, params, lora_request=self.lora_request
                )
        except Exception as exc:  # noqa: BLE001 - delivered to the asking stream
            self._abort(rid)
            request.future.set_exception(exc)

    def _abort(self, rid: str | None) -> None:
        pending = self._pending.pop(rid, None) if rid else None
        if pending is not None and self.llm is not None:
            self.llm.llm_engine.abort_request([f"{rid}:{i}" for i in range(pending.rows)])

    def _lost(self, why: str) -> None:
        self.down = why
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _step(self) -> None:
        try:
            outputs = self.llm.llm_engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine died mid-step
            failed = f"{type(exc).__name__}: {exc}"
        else:
            failed = None
        if failed is not None:  # (outside the except block: its traceback would keep the old engine alive)
            self._recover(failed)
            return
        self.steps_run += 1
        for out in outputs:
            if not out.finished:
                continue
            rid, _, row = out.request_id.partition(":")
            pending = self._pending.get(rid)
            if pending is None:
                continue
            comp = out.outputs[0]
            pending.tokens[int(row)] = list(comp.token_ids)
            pending.log_probs[int(row)] = [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)]
            if len(pending.tokens) == pending.rows:
                del self._pending[rid]
                self._finish(pending)

    def _recover(self, why: str) -> None:
        """The engine died mid-step: build a new one from the weights being served and decode the rows in flight
        again from their first token (same weights version); if it cannot be built, fail them and give up."""
        log.error("vLLM engine step failed (%s); rebuilding the engine and decoding the rows in flight again", why)
        pending = list(self._pending.values())
        self._pending.clear()
        self._discard()
        try:
            self._build(self.policy)
        except Exception as exc:  # noqa: BLE001
            log.error("vLLM engine could not be rebuilt: %s", exc)
            for p in pending:
                p.request.future.set_exception(Unavailable(f"vLLM engine failed ({why}) and could not be rebuilt"))
            self._discard()
            self._lost(f"engine step failed ({why}) and the rebuild failed: {exc}")
            return
        self.engine_builds_after_failure += 1
        for p in pending:
            self._admit(p.request)

    def _finish(self, p: _Pending) -> None:
        try:
            n = p.rows
            tokens = torch.tensor([p.tokens[i] for i in range(n)], dtype=torch.long)
            logp = torch.tensor([p.log_probs[i] for i in range(n)], dtype=torch.float32)
            out = p.policy.output_from_tokens(tokens, logp, p.values, p.prompt_inputs)
            res = out.to_numpy(p.version)
        except Exception as exc:  # noqa: BLE001
            p.request.future.set_exception(exc)
            return
        self.rows_run += n
        _FORWARD_LATENCY.record(time.monotonic() - p.t_admit)
        p.request.future.set_result(res)


def _lora_rank(policy) -> int:
    """vLLM's adapter slot size for a peft-wrapped policy: the smallest rank vLLM offers that holds its rank."""
    rank = int(policy.llm.peft_config["default"].r)
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if slot >= rank:
            return slot
    raise ValueError(f"actor.model.lora_rank {rank}: vLLM serves LoRA ranks up to 512")
