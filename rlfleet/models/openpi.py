"""π0 policy (model type ``openpi``) on transformers' native ``PI0ForConditionalGeneration``, made an RL policy the
way πRL does it (Flow-SDE).

π0: a PaliGemma VLM (SigLIP + Gemma) reads every camera image and the instruction; a Gemma action expert attends to
the VLM's KV cache and denoises an action chunk ``[num_action_chunks, max_action_dim]`` by flow matching, from
Gaussian noise at t = 1 to actions at t = 0 in ``num_denoise_steps`` Euler steps of the predicted velocity
``v = noise - action``. The robot state (the env's ``state`` entry, zero-padded to ``max_state_dim``) conditions the
expert. The first ``action_dim`` of the ``max_action_dim`` outputs are the env's action.

Log-prob (Flow-SDE): in each call one denoising step j (drawn per row) is made stochastic:
``x' ~ N(x + [v + sigma^2 / (2t) (x + (1 - t) v)] dt, sigma^2 |dt|)`` with ``sigma = noise_level sqrt(t / (1 - t))``
(``1 - t`` floored at one step, so the first step is finite); the other steps are deterministic Euler steps. The
Gaussian density of x' at step j is the log-prob (per action dimension, reduced to the configured granularity;
RLinf's π0 recipes use ``chunk_level``). Forward inputs: the prompt, x and x' of the stochastic step and j, so
``evaluate`` recomputes exactly that density with one expert pass. Deterministic acting (evaluation) runs the plain
ODE. A value head on the VLM's prefix (mean over its valid tokens) is the critic; ``train_expert_only`` freezes the
VLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from rlfleet.models.openvla import ByteTokenizer
from rlfleet.policies.base import PolicyEval, PolicyMixin, PolicyOutput, reduce_log_probs

# actor.model.openpi defaults: a tiny π0 that runs on CPU
TINY = dict(image_size=32, patch_size=16, vision_hidden_size=64, vision_layers=1, vision_heads=2,
            vision_intermediate_size=128, vlm_hidden_size=128, vlm_layers=2, vlm_heads=2, vlm_intermediate_size=256,
            expert_hidden_size=64, expert_layers=2, expert_intermediate_size=128, head_dim=32, vocab_size=512,
            max_state_dim=32, max_action_dim=32, num_denoise_steps=4, noise_level=0.5, train_expert_only=False,
            value_hidden_size=128)


class Pi0Policy(PolicyMixin, nn.Module):
    def __init__(self, obs_specs: Mapping, action_dim: int, *, sizes: Mapping | None = None,
                 num_action_chunks: int = 5, max_prompt_tokens: int = 48, add_value_head: bool = True,
                 logprob_type: str = "chunk_level"):
        super().__init__()
        from transformers import GemmaConfig, PaliGemmaConfig, PI0Config, PI0ForConditionalGeneration

        s = self.sizes = {**TINY, **dict(sizes or {})}
        self.obs_specs, self.action_dim = dict(obs_specs), int(action_dim)
        self.num_action_chunks, self.logprob_type = int(num_action_chunks), logprob_type
        self.image_keys = sorted(k for k, v in obs_specs.items() if v.is_image)
        if not self.image_keys:
            raise ValueError(f"model_type 'openpi' needs image observations; the env provides {sorted(obs_specs)}")
        self.state_keys = sorted(k for k, v in obs_specs.items() if not v.is_image)
        state_dim = sum(math.prod(obs_specs[k].shape) for k in self.state_keys)
        if state_dim > s["max_state_dim"] or action_dim > s["max_action_dim"]:
            raise ValueError(f"actor.model.openpi: state ({state_dim}) / action ({action_dim}) dims exceed "
                             f"max_state_dim {s['max_state_dim']} / max_action_dim {s['max_action_dim']}")
        self.num_steps = int(s["num_denoise_steps"])
        self.noise_level = float(s["noise_level"])
        if self.num_steps < 1 or self.noise_level <= 0:
            raise ValueError("actor.model.openpi: num_denoise_steps must be >= 1 and noise_level > 0")
        self.tokenizer = ByteTokenizer()
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.image_token_id = int(s["vocab_size"]) - 1
        self.tokens_per_image = (int(s["image_size"]) // int(s["patch_size"])) ** 2
        vision = dict(image_size=s["image_size"], patch_size=s["patch_size"], hidden_size=s["vision_hidden_size"],
                      num_hidden_layers=s["vision_layers"], num_attention_heads=s["vision_heads"],
                      intermediate_size=s["vision_intermediate_size"])
        text = dict(vocab_size=s["vocab_size"], hidden_size=s["vlm_hidden_size"],
                    intermediate_size=s["vlm_intermediate_size"], num_hidden_layers=s["vlm_layers"],
                    num_attention_heads=s["vlm_heads"], num_key_value_heads=1, head_dim=s["head_dim"])
        expert = GemmaConfig(vocab_size=8, hidden_size=s["expert_hidden_size"],
                             intermediate_size=s["expert_intermediate_size"], num_hidden_layers=s["expert_layers"],
                             num_attention_heads=s["vlm_heads"], num_key_value_heads=1, head_dim=s["head_dim"])
        if s["expert_layers"] != s["vlm_layers"]:
            raise ValueError("actor.model.openpi: the action expert attends layer by layer to the VLM's cache: "
                             "expert_layers must equal vlm_layers")
        cfg = PI0Config(vlm_config=PaliGemmaConfig(vision_config=vision, text_config=text,
                                                   image_token_id=self.image_token_id,
                                                   projection_dim=s["vlm_hidden_size"]),
                        dit_config=expert, chunk_size=self.num_action_chunks, max_state_dim=s["max_state_dim"],
                        max_action_dim=s["max_action_dim"], num_inference_steps=self.num_steps)
        self.pi0 = PI0ForConditionalGeneration(cfg)
        self.has_critic = bool(add_value_head)
        self.value_head = nn.Sequential(nn.Linear(s["vlm_hidden_size"], s["value_hidden_size"]), nn.GELU(),
                                        nn.Linear(s["value_hidden_size"], 1)) if add_value_head else None
        if s["train_expert_only"]:
            for p in self.pi0.model.vlm.parameters():
                p.requires_grad_(False)

    # --- inputs ---------------------------------------------------------------------------------------------
    def tokenize(self, instructions: Sequence[str] | None, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Instructions -> right-padded ids [n, P] and mask [n, P] (image tokens are added in _prefix)."""
        P = self.max_prompt_tokens
        ids = torch.zeros((n, P), dtype=torch.long)
        mask = torch.zeros((n, P), dtype=torch.long)
        for i, text in enumerate(list(instructions) if instructions else [""] * n):
            toks = [self.tokenizer.bos_token_id, *self.tokenizer.encode((text or "").strip().lower() + "\n")][:P]
            ids[i, :len(toks)] = torch.tensor(toks)
            mask[i, :len(toks)] = 1
        return ids.to(device), mask.to(device)

    def _inputs(self, obs: Mapping[str, torch.Tensor], prompt_ids, prompt_mask):
        n = prompt_ids.shape[0]
        size = int(self.sizes["image_size"])
        cams = []
        for k in self.image_keys:
            x = obs[k].permute(0, 3, 1, 2).float() / 255.0
            if x.shape[-1] != size or x.shape[-2] != size:
                x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
            cams.append(x * 2.0 - 1.0)  # SigLIP's [-1, 1]
        pixel_values = torch.stack(cams, 1)
        n_img = len(cams) * self.tokens_per_image
        ids = torch.cat([torch.full((n, n_img), self.image_token_id, dtype=torch.long, device=prompt_ids.device),
                         prompt_ids], 1)
        mask = torch.cat([torch.ones((n, n_img), dtype=torch.long, device=prompt_ids.device), prompt_mask], 1)
        state = torch.zeros((n, int(self.sizes["max_state_dim"])), device=prompt_ids.device)
        if self.state_keys:
            flat = torch.cat([obs[k].reshape(n, -1).float() for k in self.state_keys], 1)
            state[:, :flat.shape[1]] = flat
        return ids, mask, pixel_values, torch.ones((n, len(cams)), dtype=torch.bool, device=ids.device), state

    def _prefix(self, ids, mask, pixel_values, pixel_mask):
        """The VLM over [images][prompt]: its KV cache (for the expert) and the value-head features."""
        model = self.pi0.model
        out = model.vlm(inputs_embeds=model.embed_prefix(ids, pixel_values, pixel_mask), attention_mask=mask,
                        position_ids=mask.cumsum(-1) - 1, token_type_ids=torch.zeros_like(mask), use_cache=True)
        m = mask[..., None].to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1.0)
        return out.past_key_values, pooled

    def _velocity(self, state, x, t, mask, pixel_mask, cache):
        prefix_len = cache.get_seq_length()
        v = self.pi0(state=state, noise=x, timestep=t, attention_mask=mask, pixel_attention_mask=pixel_mask,
                     past_key_values=cache).logits
        cache.crop(prefix_len - cache.get_seq_length())  # the expert's tokens never stay in the prefix cache
        return v

    def _step_gaussian(self, x, v, t):
        """Flow-SDE step from time t (per row) by dt = -1/K: mean and std of x'."""
        dt = -1.0 / self.num_steps
        t_ = t[:, None, None]
        one_minus = (1.0 - t_).clamp(min=1.0 / self.num_steps)
        sigma = self.noise_level * torch.sqrt(t_ / one_minus)
        mean = x + (v + sigma ** 2 / (2.0 * t_.clamp(min=1e-6)) * (x + (1.0 - t_) * v)) * dt
        return mean, sigma * math.sqrt(-dt)

    def _log_prob(self, x_next, mean, std):
        """Gaussian log density per action element [n, chunk, action_dim] (the padded dims do not count)."""
        a = slice(0, self.action_dim)
        std = std.expand_as(mean)[..., a]
        z = (x_next[..., a] - mean[..., a]) / std
        return -0.5 * z ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)

    def _value(self, pooled):
        return None if self.value_head is None else self.value_head(pooled.float()).squeeze(-1)

    # --- the policy interface -------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: Mapping[str, torch.Tensor], deterministic: bool = False,
            instructions: Sequence[str] | None = None, noise=None) -> PolicyOutput:
        any_key = self.image_keys[0]
        n, device = obs[any_key].shape[0], obs[any_key].device
        prompt_ids, prompt_mask = self.tokenize(instructions, n, device)
        ids, mask, pixels, pixel_mask, state = self._inputs(obs, prompt_ids, prompt_mask)
        cache, pooled = self._prefix(ids, mask, pixels, pixel_mask)
        shape = (n, self.num_action_chunks, int(self.sizes["max_action_dim"]))
        # deterministic (evaluation): the ODE from the noise distribution's mean, so one observation, one action
        if deterministic:
            x, j = torch.zeros(shape, device=device), torch.zeros(n, dtype=torch.long, device=device)
        elif noise is not None:  # per-row streams (rlfleet.noise): the chain's start, its noisy step, its noise
            x = noise.torch_normal(shape[1:], torch.empty(0, device=device))
            j = (noise.torch_uniform((), x) * self.num_steps).long().clamp_(max=self.num_steps - 1)
        else:
            x = torch.randn(shape, device=device)
            j = torch.randint(0, self.num_steps, (n,), device=device)
        x_j, x_next = x.clone(), x.clone()
        lp_mean, lp_std = torch.zeros_like(x), torch.ones_like(x)
        for k in range(self.num_steps):
            t = torch.full((n,), 1.0 - k / self.num_steps, device=device)
            v = self._velocity(state, x, t, mask, pixel_mask, cache)
            mean, std = self._step_gaussian(x, v, t)
            ode = x + v * (-1.0 / self.num_steps)
            here = (j == k)[:, None, None]
            if deterministic:
                new = ode
            else:
                eps = torch.randn_like(mean) if noise is None else noise.torch_normal(mean.shape[1:], mean)
                new = torch.where(here, mean + std * eps, ode)
            x_j = torch.where(here, x, x_j)
            x_next = torch.where(here, new, x_next)
            lp_mean = torch.where(here, mean, lp_mean)
            lp_std = torch.where(here, std.expand_as(mean), lp_std)
            x = new
        per_dim = self._log_prob(x_next, lp_mean, lp_std)
        actions = x[..., :self.action_dim]
        return PolicyOutput(actions, reduce_log_probs(per_dim, self.logprob_type), self._value(pooled),
                            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.to(torch.uint8),
                             "x_t": x_j, "x_next": x_next, "denoise_step": j})

    def evaluate(self, obs: Mapping[str, torch.Tensor], forward_inputs: Mapping[str, torch.Tensor],
                 instructions: Sequence[str] | None = None) -> PolicyEval:
        ids, mask, pixels, pixel_mask, state = self._inputs(obs, forward_inputs["prompt_ids"].long(),
                                                            forward_inputs["prompt_mask"].long())
        cache, pooled = self._prefix(ids, mask, pixels, pixel_mask)
        x_j, x_next = forward_inputs["x_t"].float(), forward_inputs["x_next"].float()
        t = 1.0 - forward_inputs["denoise_step"].float() / self.num_steps
        v = self._velocity(state, x_j, t, mask, pixel_mask, cache)
        mean, std = self._step_gaussian(x_j, v, t)
        per_dim = self._log_prob(x_next, mean, std)
        std = std.expand_as(mean)[..., :self.action_dim]
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(std)).flatten(1).sum(1)
        return PolicyEval(reduce_log_probs(per_dim, self.logprob_type), entropy, self._value(pooled))

    def bc_loss(self, obs: Mapping[str, torch.Tensor], actions: torch.Tensor,
                instructions: Sequence[str] | None = None) -> torch.Tensor:
        """π0's flow-matching loss on demonstrated chunks [n, chunk, action_dim]: at a time t ~ Beta(1.5, 1)
        (π0's schedule, weighted to the noisy end) the expert's velocity at x_t = t noise + (1 - t) a must be
        noise - a."""
        n, device = actions.shape[0], actions.device
        prompt_ids, prompt_mask = self.tokenize(instructions, n, device)
        ids, mask, pixels, pixel_mask, state = self._inputs(obs, prompt_ids, prompt_mask)
        cache, _ = self._prefix(ids, mask, pixels, pixel_mask)
        target = torch.zeros((n, self.num_action_chunks, int(self.sizes["max_action_dim"])), device=device)
        target[..., :self.action_dim] = actions.float().view(n, self.num_action_chunks, self.action_dim)
        noise = torch.randn_like(target)
        t = torch.distributions.Beta(1.5, 1.0).sample((n,)).to(device) * 0.999 + 0.001
        x_t = t[:, None, None] * noise + (1.0 - t[:, None, None]) * target
        v = self._velocity(state, x_t, t, mask, pixel_mask, cache)
        a = slice(0, self.action_dim)
        return F.mse_loss(v[..., a].float(), (noise - target)[..., a])

    def save_pretrained(self, path) -> None:
        """config.json (model type and sizes) + model.safetensors, the layout actor.model.model_path loads."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in self.state_dict().items()},
                  str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": "openpi", "openpi": self.sizes,
                                                      "num_action_chunks": self.num_action_chunks}, indent=2))

    @classmethod
    def from_config(cls, model_cfg, obs_specs: Mapping, action_dim: int, normalize_obs: bool,
                    logprob_type: str = "chunk_level") -> Pi0Policy:
        sizes, state = dict(model_cfg.openpi), None
        if model_cfg.model_path:
            import json
            from pathlib import Path

            from safetensors.torch import load_file

            path = Path(model_cfg.model_path)
            if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
                raise FileNotFoundError(f"actor.model.model_path: {path} needs config.json and model.safetensors "
                                        f"(rlfleet's π0 checkpoint layout, written by save_pretrained)")
            saved = json.loads((path / "config.json").read_text())
            # the architecture comes from the checkpoint; RL-side knobs (noise level, expert-only) from the config
            keep = ("noise_level", "train_expert_only", "num_denoise_steps", "value_hidden_size")
            sizes = {**saved.get("openpi", {}), **{k: sizes[k] for k in keep if k in sizes}}
            state = load_file(str(path / "model.safetensors"))
        policy = cls(obs_specs, action_dim, sizes=sizes, num_action_chunks=model_cfg.num_action_chunks,
                     max_prompt_tokens=model_cfg.max_prompt_tokens, add_value_head=model_cfg.add_value_head,
                     logprob_type=logprob_type)
        if state is not None:
            missing, unexpected = policy.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith("value_head.")]  # a fresh critic is expected
            unexpected = [k for k in unexpected if not k.startswith("value_head.")]
            if missing or unexpected:
                raise ValueError(f"{model_cfg.model_path}/model.safetensors: missing tensors {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
        return policy
