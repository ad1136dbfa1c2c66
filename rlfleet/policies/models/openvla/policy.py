"""The policy: ``OpenVLAPolicy`` (act, evaluate, expert inputs) assembled from the architecture and its roles."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlfleet.policies.base import PolicyEval, PolicyMixin, PolicyOutput, reduce_log_probs, sample_categorical
from rlfleet.policies.models.openvla.action_head import ActionHeadMixin
from rlfleet.policies.models.openvla.architecture import OpenVLAArchitecture
from rlfleet.policies.models.openvla.checkpoint import CheckpointMixin
from rlfleet.policies.models.openvla.serving import ServingMixin


class OpenVLAPolicy(CheckpointMixin, ServingMixin, ActionHeadMixin, PolicyMixin, OpenVLAArchitecture):
    """Model types ``openvla`` (action tokens decoded one by one) and ``openvla_oft`` (a chunk in one bidirectional
    forward); see the package's docstring."""

    def __init__(
        self,
        obs_specs: Mapping,
        action_dim: int,
        *,
        model_type: str = "openvla",
        sizes: Mapping | None = None,
        num_action_chunks: int = 1,
        temperature: float = 1.0,
        image_key: str | None = None,
        max_prompt_tokens: int = 64,
        add_value_head: bool = True,
        is_lora: bool = False,
        lora_rank: int = 32,
        gradient_checkpointing: bool = False,
        unnorm_stats: Mapping | None = None,
        tokenizer=None,
        logprob_type: str = "token_level",
        use_proprio: bool = False,
        proprio_stats: Mapping | None = None,
        extra_image_keys: Sequence[str] = (),
    ):
        super().__init__(
            obs_specs,
            action_dim,
            model_type=model_type,
            sizes=sizes,
            num_action_chunks=num_action_chunks,
            temperature=temperature,
            image_key=image_key,
            max_prompt_tokens=max_prompt_tokens,
            add_value_head=add_value_head,
            gradient_checkpointing=gradient_checkpointing,
            tokenizer=tokenizer,
            logprob_type=logprob_type,
            use_proprio=use_proprio,
            proprio_stats=proprio_stats,
            extra_image_keys=extra_image_keys,
        )
        self._init_action_head(action_dim, unnorm_stats)
        if is_lora:
            self.enable_lora(lora_rank)

    # --- the policy interface -----------------------------------------------------------------------------------
    @torch.no_grad()
    def act(
        self,
        obs: Mapping[str, torch.Tensor],
        deterministic: bool = False,
        instructions: Sequence[str] | None = None,
        noise=None,
    ) -> PolicyOutput:
        images = obs[self.image_key]
        n = images.shape[0]
        prompt_ids, prompt_mask = self.tokenize(instructions, n, images.device)
        emb, mask = self._prefix(obs, prompt_ids, prompt_mask)
        S, D = emb.shape[1], self.num_action_tokens
        if self.parallel:
            queries = self.action_query.to(emb.dtype).expand(n, D, -1)
            full_mask = torch.cat([mask, torch.ones((n, D), dtype=torch.long, device=mask.device)], 1)
            body = self._lm()[0]
            hidden = body(
                inputs_embeds=torch.cat([emb, queries], 1),
                attention_mask=self._bidirectional_mask(full_mask, S),
                position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
            ).last_hidden_state
            logits = self._action_logits(hidden[:, S:])
            bins = logits.argmax(-1) if deterministic else sample_categorical(logits, noise)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, bins[..., None]).squeeze(-1)
            value = self._value(hidden[:, S - 1])
        else:
            out = self._forward(emb, mask, use_cache=True)
            cache, h = out.past_key_values, out.last_hidden_state[:, -1]
            value = self._value(h)
            bins_l, logp_l = [], []
            embed = self._lm()[0].embed_tokens
            for t in range(D):
                logits = self._action_logits(h)
                b = logits.argmax(-1) if deterministic else sample_categorical(logits, noise)
                bins_l.append(b)
                logp_l.append(torch.log_softmax(logits.float(), -1).gather(-1, b[:, None]).squeeze(-1))
                if t == D - 1:
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=mask.device)], 1)
                tok = (self.action_end - 1 - b)[:, None]
                pos = mask.sum(1, keepdim=True) - 1
                h = self._lm()[0](
                    inputs_embeds=embed(tok),
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                ).last_hidden_state[:, -1]
            bins, logp = torch.stack(bins_l, 1), torch.stack(logp_l, 1)
        return self._output(bins, logp, value, prompt_ids, prompt_mask)

    def evaluate(
        self,
        obs: Mapping[str, torch.Tensor],
        forward_inputs: Mapping[str, torch.Tensor],
        instructions: Sequence[str] | None = None,
    ) -> PolicyEval:
        bins = forward_inputs["action_bins"].long()
        emb, mask = self._prefix(obs, forward_inputs["prompt_ids"].long(), forward_inputs["prompt_mask"].long())
        n, S, D = emb.shape[0], emb.shape[1], self.num_action_tokens
        if self.parallel:
            queries = self.action_query.to(emb.dtype).expand(n, D, -1)
            full_mask = torch.cat([mask, torch.ones((n, D), dtype=torch.long, device=mask.device)], 1)
            hidden = self._lm()[0](
                inputs_embeds=torch.cat([emb, queries], 1),
                attention_mask=self._bidirectional_mask(full_mask, S),
                position_ids=(full_mask.cumsum(1) - 1).clamp(min=0),
            ).last_hidden_state
            predicting = hidden[:, S:]
        else:  # teacher forcing: the prefix and all but the last action token; keep only the predicting positions
            embed = self._lm()[0].embed_tokens
            toks = self.action_end - 1 - bins[:, :-1]
            full_mask = torch.cat([mask, torch.ones((n, D - 1), dtype=torch.long, device=mask.device)], 1)
            hidden = self._forward(torch.cat([emb, embed(toks)], 1), full_mask).last_hidden_state
            predicting = hidden[:, S - 1 :]
        logits = self._action_logits(predicting).float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, bins[..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).sum(-1)
        per_dim = logp.view(n, self.num_action_chunks, self.action_dim)
        return PolicyEval(reduce_log_probs(per_dim, self.logprob_type), entropy, self._value(hidden[:, S - 1]))

    def expert_forward_inputs(self, obs, actions, instructions=None) -> dict[str, torch.Tensor]:
        images = obs[self.image_key]
        prompt_ids, prompt_mask = self.tokenize(instructions, images.shape[0], images.device)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask.to(torch.uint8),
            "action_bins": self.action_bins(actions),
        }
