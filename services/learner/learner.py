"""Learner: the learner service's core (no gRPC), on every rank of the learner's group.

Rank 0 is the face: it takes rollouts (``RolloutStore``), has the algorithm (``algorithm.name``: the seam in
``algorithms/``) turn an epoch's rollouts into its work (PPO: one batch with advantages), gives each rank its rows,
and tells the other ranks what to do; they run :meth:`follow`. Every step that touches the (sharded) policy runs as
a command on every rank in the same order: set-up, the critic's values of rows the algorithm asks for, an update
(the algorithm's), a gather of the weights for the inference servers (``WeightPublisher``), a checkpoint
(``checkpoint.py``), an export. In a group of one (the default) the commands are plain calls.
"""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import time

import numpy as np
import torch
from opentelemetry import metrics, trace

from rlfleet.config.views import LearnerView
from rlfleet.data.checkpoint_files import checkpoint_dir, verify_checkpoint
from rlfleet.data.checkpoint_files import specs_from_json as _specs_from_json
from rlfleet.data.checkpoint_files import specs_to_json as _specs_to_json
from rlfleet.data.loggers import LoggerOptions
from rlfleet.data.metrics import MetricsLogger
from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.policies import build_policy, families, footprint
from rlfleet.untrusted import BadFile
from rlfleet.wire.spaces import TensorSpace
from services.learner import checkpoint, warmup
from services.learner.algorithms.base import Prepared
from services.learner.algorithms.factory import make_algorithm
from services.learner.checkpoint import latest_checkpoint
from services.learner.group import RankGroup
from services.learner.publisher import WeightPublisher
from services.learner.rollouts import RolloutStore, forward_input_specs, policy_inputs
from services.learner.sharding import full_state_dict, gather_buckets, is_sharded, local_bytes, shard_policy

log = logging.getLogger("rlfleet.learner")
_tracer = trace.get_tracer("rlfleet")
_TRAIN_TIME = metrics.get_meter("rlfleet").create_histogram("rlfleet.learner.train_time", "s", "one epoch's update")

__all__ = ["Learner", "latest_checkpoint", "update_threads"]

# policies whose update runs on cluster.torch_num_threads even in sync mode (cluster.learner_num_threads: null)
SMALL_UPDATE_MODELS = frozenset({"mlp"})


def update_threads(view: LearnerView, local_ranks: int = 1) -> int:
    """Torch threads of the update (cluster.learner_num_threads; null: in sync mode nothing else runs while the
    learner trains, so its ranks share every core this process may use; in async mode the envs are collecting
    beside it; an MLP's update is too small to split over intra-op threads: one thread, whose update and epoch are
    faster, docs/benchmarks.md#the-learners-threads-2026-11-27-later; in sync mode its critic's half of each step
    may still run on a second thread: Trainer.critic_apart)."""
    if view.learner_num_threads is not None:
        return view.learner_num_threads
    if view.algorithm.max_staleness > 0 or view.model.model_type in SMALL_UPDATE_MODELS:
        return max(1, view.torch_num_threads)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_ranks))


class Learner:
    def __init__(
        self, view: LearnerView, run_dir: str | pathlib.Path, device: str = "cpu", group: RankGroup | None = None
    ):
        if not isinstance(view, LearnerView):
            raise TypeError(
                f"Learner takes the learner's config view (rlfleet.config.views.learner_view), "
                f"not {type(view).__name__}"
            )
        self.view = view
        self.alg = view.algorithm
        self.run_dir = pathlib.Path(run_dir)
        self.group = group or RankGroup(device=device)
        self.device = self.group.device
        self.model = None
        self.ref_model = None  # algorithm.kl_beta > 0 without LoRA: a frozen copy of the start, sharded alike
        self.optimizer: torch.optim.Optimizer | None = None
        self.obs_specs: dict[str, TensorSpace] | None = None
        self.action_dim: int | None = None
        self.version = 0  # weights version (number of updates applied)
        self.env_steps = 0
        self.elapsed_s = 0.0  # training wall time, as measured by the coordinator (restored on resume)
        self.last_checkpoint = ""
        self.publish_error = ""
        self.rollouts = RolloutStore(view.algorithm, view.num_env_servers)
        self.algorithm = make_algorithm(view, self.group)  # algorithm.name: its data store, batches and update
        # each weights stream has the deadline of the coordinator's PublishWeights (a real-size first set takes
        # minutes: building the served copies, tens of GB of fp32 weights)
        self.publisher = WeightPublisher(
            timeout=max(120.0, view.rpc_timeout_s), shared_memory=view.shared_memory == "auto"
        )
        options = LoggerOptions(
            project_name=view.project_name,
            experiment_name=view.experiment_name,
            wandb_mode=view.wandb_mode,
            swanlab_mode=view.swanlab_mode,
        )
        self.logger = MetricsLogger(self.run_dir, view.logger_backends, options) if self.group.is_leader else None
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.group.distributed else 1
        self.update_threads = update_threads(view, local_ranks)
        self._prepared: Prepared | None = None  # the epoch being trained (rank 0)

    @property
    def epoch(self) -> int:
        """The last trained epoch."""
        return self.rollouts.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.rollouts.epoch = value

    @property
    def last_sync_bytes(self) -> int:
        return self.publisher.last_bytes

    # --- commands: rank 0 runs them everywhere ---------------------------------------------------------------
    def _run(self, name: str, meta: dict | None = None, tensors: list | None = None):
        """Rank 0: run command ``name`` on every rank (this one included), in order with every other command."""
        with self.group.lock:
            mine = self.group.command(name, meta, tensors)
            return getattr(self, f"_on_{name}")(meta or {}, mine)

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's commands until it says stop."""
        while True:
            name, meta, tensors = self.group.next_command()
            if name == "stop":
                return
            try:
                getattr(self, f"_on_{name}")(meta, tensors)
            except FailedPrecondition as exc:  # rank 0 reaches the same verdict and reports it
                log.warning("rank %d: %s: %s", self.group.rank, name, exc)

    # --- model ----------------------------------------------------------------------------------------------
    def setup(self, obs_specs: dict[str, TensorSpace], action_dim: int) -> None:
        """Build the policy for the env's spaces (once); restore the last checkpoint when resuming."""
        warmup.wait()  # the optimizer's import, done ahead (warmup.py): never two imports at once
        if self.model is not None:
            if obs_specs != self.obs_specs or action_dim != self.action_dim:
                raise InvalidRequest(
                    f"env_spec: spaces {obs_specs}/{action_dim} differ from the policy's "
                    f"{self.obs_specs}/{self.action_dim}"
                )
            return
        # the spaces decide the policy's size: refuse what could never be served or would not fit this host's
        # memory before any rank builds it (rlfleet.wire.weights)
        footprint.observation_row_bytes(obs_specs, "env_spec.observation_space")
        planned = footprint.planned_state(
            self.view.model,
            obs_specs,
            action_dim,
            self.alg.normalize_obs,
            self.alg.logprob_type,
            "env_spec.observation_space",
        )
        if planned is not None:
            spaces = ", ".join(f"{k}{list(s.shape)}" for k, s in obs_specs.items())
            footprint.check_fits(
                footprint.state_bytes(planned),
                f"env_spec.observation_space: a "
                f"{self.view.model.model_type} policy for spaces {spaces} (action "
                f"{action_dim}-D)",
            )
        extra, key = self.algorithm.planned_bytes(obs_specs, action_dim)
        if extra:  # the algorithm's own data (a replay buffer's share) lives in this host's memory
            footprint.check_fits(extra, f"{key}: {self.algorithm.name}'s data on each learner rank", "cpu")
        meta = {"obs_specs": _specs_to_json(obs_specs), "action_dim": int(action_dim)}
        if self.view.resume_dir:
            ckpt = latest_checkpoint(self.view.resume_dir)
            if ckpt is None:
                raise FailedPrecondition(f"runner.resume_dir: no checkpoint in {self.view.resume_dir}/checkpoints")
            try:  # the whole checkpoint, before any rank builds or loads anything: a bad file named in seconds
                verify_checkpoint(ckpt)
            except (BadFile, OSError) as exc:
                log.error("cannot resume from %s: %s", ckpt, exc)
                raise FailedPrecondition(f"runner.resume_dir: {exc}") from None
            meta["resume"] = str(ckpt)
        self._run("setup", meta)

    def _on_setup(self, meta: dict, _tensors) -> None:
        warmup.wait()
        torch.manual_seed(self.view.seed)  # the same initial weights on every rank
        obs_specs, action_dim = _specs_from_json(meta["obs_specs"]), int(meta["action_dim"])
        model = build_policy(
            self.view.model, obs_specs, action_dim, self.alg.normalize_obs, self.alg.logprob_type, device=self.device
        )
        only_eval = self.view.only_eval  # serving weights for an evaluation: no rollouts, reference, optimizer
        # the forward inputs a rollout must carry (names, per-row shapes): asked of the whole policy, before sharding
        # (a dummy act; an evaluation's learner receives no rollouts and never runs the policy)
        fi_specs = (
            forward_input_specs(model, obs_specs, self.device) if self.group.is_leader and not only_eval else None
        )
        # the KL reference is the model as built (model_path: the SFT base), also on resume: with LoRA the base
        # itself with the adapters off, else a frozen copy (sharded like the policy)
        if self.alg.kl_beta > 0 and not model.trains_adapters_only and not only_eval:
            ref = copy.deepcopy(model).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self.ref_model = shard_policy(ref, self.group)
        self.model = shard_policy(model, self.group)
        if not only_eval:
            self.optimizer = self.algorithm.optimizer(self.model)
        self.obs_specs, self.action_dim = obs_specs, action_dim
        r = self.rollouts
        r.obs_specs, r.action_dim = obs_specs, action_dim
        r.chunk, r.log_prob_width = self.model.num_action_chunks, self.model.log_prob_width
        r.fi_specs = fi_specs
        if only_eval:
            r.refusal = "runner.only_eval: this learner serves weights for an evaluation and takes no rollouts"
        if not only_eval:
            self.algorithm.setup(obs_specs, action_dim)
        if "resume" in meta:
            self._load_checkpoint(pathlib.Path(meta["resume"]))
        if not only_eval:
            self.algorithm.start(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy state on the CPU (rank 0), gathered from every rank's shards."""
        return self._run("state")

    def _on_state(self, _meta, _tensors) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.group.is_leader)

    def memory(self) -> list[dict[str, int]]:
        """Per rank: bytes it holds of the policy's parameters and of the optimizer's state (measured on each
        rank from its own tensors: a DTensor counts its local shard)."""
        return self._run("memory")

    def _on_memory(self, _meta, _tensors) -> list[dict[str, int]]:
        states = self.optimizer.state.values() if self.optimizer is not None else ()
        opt = [t for s in states for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        mine = torch.zeros(self.group.world, 2, dtype=torch.int64, device=self.device)
        mine[self.group.rank] = torch.tensor([local_bytes(self.model.parameters()), local_bytes(opt)])
        every = self.group.all_reduce(mine).tolist()
        return [{"parameters": a, "optimizer": b} for a, b in every]

    # --- training -------------------------------------------------------------------------------------------
    def train(
        self,
        epoch: int,
        workers: list[int],
        extra_metrics: dict[str, float] | None = None,
        inference_addresses: list[str] | None = None,
    ) -> dict[str, float]:
        """The algorithm's update on the rollouts of ``epoch`` from ``workers``; then publish, checkpoint, log."""
        if self.model is None:
            raise FailedPrecondition("the learner has no policy yet")
        if self.optimizer is None:
            raise FailedPrecondition(
                "runner.only_eval: this learner serves weights for an evaluation and never trains (it has no optimizer)"
            )
        if epoch != self.epoch + 1:
            raise InvalidRequest(f"epoch: {epoch} is not the next epoch (last trained: {self.epoch})")
        self.rollouts.set_workers(workers)  # the run's current scale (coordinatorctl scale env N)
        parts = self.rollouts.take(epoch, workers)
        t0 = time.perf_counter()
        critic = self.values if self.model.has_critic else None
        self._prepared = prepared = self.algorithm.prepare(parts, sorted(workers), epoch, critic)
        with _tracer.start_as_current_span(
            f"{self.algorithm.name}_update",
            attributes={"rlfleet.epoch": epoch, "rlfleet.samples": int(prepared.meta.get("total", 0))},
        ):
            stats = self._run("train", prepared.meta, prepared.shards)
        self.env_steps += prepared.env_steps
        train_time = time.perf_counter() - t0
        _TRAIN_TIME.record(train_time)
        t1 = time.perf_counter()
        self.publish_error = ""
        if inference_addresses:
            try:
                with _tracer.start_as_current_span(
                    "publish_weights", attributes={"rlfleet.weights_version": self.version}
                ):
                    self.publish(inference_addresses)
            except Exception as exc:  # noqa: BLE001 - the update stands; the coordinator republishes
                self.publish_error = str(exc)
                log.warning("publishing weights version %d failed: %s", self.version, exc)
        metrics = self._env_metrics(parts)
        metrics.update(self.algorithm.metrics(prepared, stats))
        wire = self.publisher.last_wire if inference_addresses else None
        metrics.update(
            {
                "time/train": train_time,
                "time/weight_sync": time.perf_counter() - t1,
                "train/weight_sync_bytes": float(self.last_sync_bytes),
                # the publish's share of the wire: serialising it (every server), bytes in messages and
                # through shared memory
                "time/wire/weights_s": wire.seconds if wire else 0.0,
                "wire/weights_bytes": float(wire.bytes if wire else 0),
                "wire/weights_shm_bytes": float(wire.shm_bytes if wire else 0),
                "env/env_steps": float(self.env_steps),
                "train/weights_version": float(self.version),
                "train/learner_ranks": float(self.group.world),
            }
        )
        metrics.update(extra_metrics or {})
        self.elapsed_s = metrics.get("time/elapsed", self.elapsed_s)
        if (epoch + 1) % self.view.save_interval == 0:
            self.save_checkpoint()
        self.logger.log(epoch + 1, metrics)
        self._prepared = None
        return metrics

    def values(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The critic's values of ``rows`` (obs.* and fi.*, flat) with the current weights (every rank runs the
        forward passes: a sharded policy's are collectives) -> [R] on rank 0."""
        return self._run("values", {}, [rows] * self.group.world)["values"]

    @torch.no_grad()
    def _on_values(self, _meta: dict, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = {k: v.to(self.device) for k, v in rows.items()}
        R = len(next(iter(rows.values())))
        # padded to the blocks the inference server acts in: a row's value is the number it would have served
        block = families.batch_invariant_rows(self.view.batch_invariant_rows, self.view.model.model_type)
        size = self.view.micro_batch_size
        if block > 0:
            size = max(block, size // block * block)
        # the critic alone where it is apart from the actor (the same numbers, without the actor's forward); a
        # sharded policy gathers its parameters only in the methods registered with FSDP (evaluate)
        critic_only = getattr(self.model, "critic_apart", False) and not is_sharded(self.model)
        out = []
        for i in range(0, R, size):
            idx = torch.arange(i, min(R, i + size), device=self.device)
            if block > 0 and len(idx) % block:
                idx = torch.cat([idx, idx[:1].expand(block - len(idx) % block)])
            with self.model.precision():
                if critic_only:
                    v = self.model.value(policy_inputs(rows, idx)[0])
                else:
                    v = self.model.evaluate(*policy_inputs(rows, idx)).values
            v = torch.zeros(len(idx), device=self.device) if v is None else v  # a policy without a critic
            out.append(v[: min(R, i + size) - i].float())
        return {"values": torch.cat(out).cpu() if out else torch.zeros(0)}

    def _on_train(self, meta: dict, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        threads = torch.get_num_threads()
        torch.set_num_threads(self.update_threads)
        try:
            stats = self.algorithm.update(
                self.model, self.optimizer, meta, rows, version=self.version, ref_model=self.ref_model
            )
        finally:
            torch.set_num_threads(threads)
        if self.group.is_leader:
            self.algorithm.after_update(self.model, self._prepared)
        self.group.broadcast_([b for b in self.model.buffers() if b.numel()])  # rank 0's buffers on every rank
        self.epoch, self.version = meta["epoch"], self.version + 1
        return stats

    @staticmethod
    def _env_metrics(parts: list[dict]) -> dict[str, float]:
        """What the envs saw in the epoch's rollouts (any algorithm)."""
        raw_rewards = np.concatenate([p["time"]["rewards"] for p in parts], axis=1)
        episodes = [e for p in parts for e in p["episodes"]]
        m = {"env/reward": float(raw_rewards.mean()), "env/num_episodes": float(len(episodes))}
        if episodes:
            m["env/success_once"] = float(np.mean([e.success_once for e in episodes]))
            m["env/success_at_end"] = float(np.mean([e.success_at_end for e in episodes]))
            m["env/return"] = float(np.mean([e.episode_return for e in episodes]))
            m["env/episode_len"] = float(np.mean([e.length for e in episodes]))
        return m

    def elapsed(self) -> float:
        return self.elapsed_s

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(step, metrics)

    # --- weights to the inference servers --------------------------------------------------------------------
    def publish(self, addresses: list[str], full: bool = False) -> int:
        """Send the current weights to ``addresses`` (``full``: a full set to every one, e.g. a run's start or an
        inference server's restart); -> bytes per server."""
        if full:
            self.publisher.synced.difference_update(addresses)
        state = self.model.state_dict()
        full_names = list(state)
        partial_names = list(self.model.sync_state_dict())
        sizes = {n: t.numel() * t.element_size() for n, t in state.items()}  # metadata only (sharded: global sizes)

        bucket = int(self.view.weights_bucket_mb * 2**20)

        def gather(names: list[str]):
            self.group.command("gather", {"names": names, "bucket": bucket})
            return self._gather(names, bucket)

        def set_bytes(names: list[str]) -> int:
            return sum(sizes.get(n, 0) for n in names)

        with self.group.lock:
            return self.publisher.publish(
                addresses, self.version, gather, full_names, partial_names, self.obs_specs, self.action_dim, set_bytes
            )

    def _gather(self, names: list[str], bucket: int):
        state = self.model.state_dict()
        return gather_buckets({n: state[n] for n in names}, bucket, self.group.is_leader)

    def _on_gather(self, meta: dict, _tensors) -> None:  # the other ranks' half of a publish
        for _ in self._gather(meta["names"], meta["bucket"]):
            pass

    # --- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> pathlib.Path:
        if self.optimizer is None:
            raise FailedPrecondition(
                "runner.only_eval: this learner serves weights for an evaluation; it has no "
                "optimizer state to checkpoint"
            )
        if self.group.is_leader:
            for k, v in self.algorithm.leader_state().items():
                if v.is_floating_point() and not torch.isfinite(v).all():
                    raise FailedPrecondition(
                        f"not saving a checkpoint: 'reward_rms.{k}' holds non-finite values "
                        f"(last good checkpoint: {self.last_checkpoint or 'none'})"
                    )
        path = checkpoint_dir(self.run_dir, self.epoch + 1)
        return self._run("save", {"path": str(path)})

    def _on_save(self, meta: dict, _tensors) -> pathlib.Path:
        path = pathlib.Path(meta["path"])
        names = list(self.model.state_dict().items())
        first_bad = len(names)
        for i, (_name, t) in enumerate(names):  # never overwrite a good checkpoint with a broken state
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_floating_point() and not torch.isfinite(local).all():
                first_bad = i
                break
        first_bad = int(self.group.all_reduce(torch.tensor([first_bad], device=self.device), "min").item())
        if first_bad < len(names):
            raise FailedPrecondition(
                f"not saving a checkpoint: '{names[first_bad][0]}' holds non-finite values "
                f"(last good checkpoint: {self.last_checkpoint or 'none'})"
            )
        path.mkdir(parents=True, exist_ok=True)
        checkpoint.save_sharded(path, self.model, self.optimizer)
        self.algorithm.save_rank_files(path)
        self.group.all_reduce(torch.zeros(1, device=self.device))  # every rank's files written before the marker
        if self.group.is_leader:
            checkpoint.write_leader_files(
                path,
                self.algorithm.leader_state(),
                {
                    "epoch": self.epoch,
                    "weights_version": self.version,
                    "env_steps": self.env_steps,
                    "elapsed_s": self.elapsed(),
                    "action_dim": self.action_dim,
                    "obs_specs": _specs_to_json(self.obs_specs),
                    "world_size": self.group.world,
                },
            )
            log.info("checkpoint %s", path)
        self.last_checkpoint = str(path)
        return path

    def _load_checkpoint(self, path: pathlib.Path) -> None:
        """Every rank (inside set-up): the shards of the policy and optimizer (runner.only_eval: the policy's
        alone), then the counters. A file that cannot be read (checked and named by rlfleet.data.checkpoint_files)
        is logged and refused as FailedPrecondition, on every rank alike."""
        try:
            if self.optimizer is None:
                checkpoint.load_policy_state(path, self.model)
            else:
                checkpoint.load_sharded(path, self.model, self.optimizer)
            reward_state, state = checkpoint.read_leader_files(path)
            if self.optimizer is not None:
                self.algorithm.load_rank_files(path)
        except (BadFile, OSError) as exc:
            log.error("rank %d: cannot resume from %s: %s", self.group.rank, path, exc)
            raise FailedPrecondition(f"runner.resume_dir: {exc}") from None
        if self.group.is_leader:
            self.algorithm.load_leader_state(reward_state)
            # the killed run may have logged epochs after this checkpoint: they are trained (and logged) again
            self.logger.resume_at(state["epoch"] + 1)
        self.epoch, self.version = state["epoch"], state["weights_version"]
        self.env_steps, self.elapsed_s = state["env_steps"], state["elapsed_s"]
        self.last_checkpoint = str(path)
        if self.group.is_leader:
            print(
                f"learner: resumed from {path} (epoch {self.epoch}, env steps {self.env_steps}, saved by "
                f"{state.get('world_size', 1)} rank(s), resumed by {self.group.world})",
                flush=True,
            )

    # --- export -----------------------------------------------------------------------------------------------
    def export(self, path: str | pathlib.Path, lora: str = "merged", layout: str = "upstream") -> pathlib.Path:
        """The policy in its family's released layout (services/learner/export.py: ``layout`` upstream or rlfleet;
        LoRA merged, or with ``lora="adapter"`` as a peft adapter), gathered whole on rank 0."""
        if not hasattr(self.model, "save_pretrained"):
            raise FailedPrecondition(f"{self.view.model.model_type} policies have no released layout to export")
        return self._run("export", {"path": str(path), "lora": lora, "layout": layout})

    def _on_export(self, meta: dict, _tensors):
        from services.learner.export import write_export

        state = full_state_dict(self.model, self.group.is_leader)
        if not self.group.is_leader:
            return None
        plain = build_policy(
            self.view.model, self.obs_specs, self.action_dim, self.alg.normalize_obs, self.alg.logprob_type
        )
        plain.load_state_dict(state)
        for attr in ("unnorm_stats", "proprio_stats", "unnorm_name"):  # what save_pretrained writes beside weights
            if hasattr(self.model, attr):
                setattr(plain, attr, getattr(self.model, attr))
        return write_export(
            plain,
            meta["path"],
            meta.get("lora", "merged"),
            self.view.model.get("model_path"),
            layout=meta.get("layout", "upstream"),
            step=self.epoch + 1,
        )

    def close(self) -> None:
        self.algorithm.close()
        if self.group.is_leader:
            if self.group.distributed:
                with self.group.lock:
                    self.group.command("stop")
            self.logger.close()
            self.publisher.close()
        self.group.close()
