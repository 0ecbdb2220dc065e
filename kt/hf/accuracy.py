"""How closely a patched model agrees with the unpatched one: logits KL and greedy tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Agreement", "compare_models", "compare_logits", "greedy_tokens", "random_prompts",
           "KL_BOUNDS", "kl_bound"]

# Mean per-token KL(unpatched || patched) a patched model must stay within, per scheme (nats).
# BF16 also requires identical greedy tokens. INT4 is with G = 64.
KL_BOUNDS = {"bf16": 1e-4, "int8": 2e-3, "int4": 2e-2}


def kl_bound(scheme) -> float:
    from ..config import QuantScheme

    return KL_BOUNDS[QuantScheme.parse(scheme).value]


@dataclass(frozen=True)
class Agreement:
    """Agreement of a model under test with a reference model on the same prompts.

    mean_kl / max_kl: KL(p_ref || p_test) per token position, in nats (fp64 softmax).
    max_abs_diff: largest |logit_ref - logit_test| over all positions and the vocabulary.
    top1_match: fraction of positions whose argmax agrees.
    greedy_match: for greedy decoding of ``greedy_steps`` tokens after each prompt, the number
      of leading tokens that agree (the minimum over prompts).
    greedy_tie_gap: where greedy decoding diverged, the reference's own gap between its top two
      logits at that step (the largest over diverging prompts; None if none diverged). A gap
      below max_abs_diff means the divergence is a near-tie the logit error can flip.
    """

    mean_kl: float
    max_kl: float
    max_abs_diff: float
    top1_match: float
    greedy_match: int
    greedy_steps: int
    positions: int
    greedy_tie_gap: float | None = None

    @property
    def greedy_identical(self) -> bool:
        return self.greedy_match == self.greedy_steps

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        return (f"mean KL {self.mean_kl:.3e} (max {self.max_kl:.3e}) over {self.positions} tokens, "
                f"max |dlogit| {self.max_abs_diff:.3e}, top-1 agree {100 * self.top1_match:.1f}%, "
                f"greedy {self.greedy_match}/{self.greedy_steps} tokens identical"
                + (f" (diverged at a top-2 logit gap of {self.greedy_tie_gap:.1e})"
                   if self.greedy_tie_gap is not None else ""))


def random_prompts(vocab_size: int, n: int = 3, length: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """``n`` prompts of token ids [1, length] drawn uniformly from the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (1, length), generator=gen) for _ in range(n)]


def _as_ids(prompt, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"a prompt must be token ids [S] or [1, S] with S >= 1, got {tuple(ids.shape)}")
    return ids.to(device)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def compare_logits(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> dict:
    """KL(p_ref || p_test) per position, max |diff|, argmax agreement of logits [..., V]."""
    r = ref_logits.double().reshape(-1, ref_logits.shape[-1]).cpu()
    t = test_logits.double().reshape(-1, test_logits.shape[-1]).cpu()
    if r.shape != t.shape:
        raise ValueError(f"logits shapes differ: {tuple(r.shape)} vs {tuple(t.shape)}")
    lr, lt = r.log_softmax(-1), t.log_softmax(-1)
    kl = (lr.exp() * (lr - lt)).sum(-1).clamp_min(0.0)
    return {"kl": kl, "max_abs_diff": float((r - t).abs().max()),
            "top1": (r.argmax(-1) == t.argmax(-1)).double()}


@torch.no_grad()
def greedy_tokens(model, prompt, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` (the KV cache path, as in generation)."""
    ids = _as_ids(prompt, _device(model))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, num_beams=1,
                         pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def compare_models(ref_model, test_model, prompts, *, greedy_steps: int = 16) -> Agreement:
    """Run both models on each prompt; see ``Agreement``. Prompts: token ids [S] or [1, S]."""
    kls, top1, max_diff, greedy, gaps = [], [], 0.0, [], []
    for p in prompts:
        lr = ref_model(_as_ids(p, _device(ref_model))).logits
        lt = test_model(_as_ids(p, _device(test_model))).logits
        c = compare_logits(lr, lt)
        kls.append(c["kl"])
        top1.append(c["top1"])
        max_diff = max(max_diff, c["max_abs_diff"])
        if greedy_steps:
            a = greedy_tokens(ref_model, p, greedy_steps)
            b = greedy_tokens(test_model, p, greedy_steps)
            same = 0
            while same < len(a) and same < len(b) and a[same] == b[same]:
                same += 1
            greedy.append(same)
            if same < greedy_steps:
                ctx = torch.cat([_as_ids(p, "cpu")[0], torch.tensor(a[:same], dtype=torch.long)])
                top2 = ref_model(ctx[None].to(_device(ref_model))).logits[0, -1].double().topk(2).values
                gaps.append(float(top2[0] - top2[1]))
    kl = torch.cat(kls)
    return Agreement(mean_kl=float(kl.mean()), max_kl=float(kl.max()), max_abs_diff=max_diff,
                     top1_match=float(torch.cat(top1).mean()),
                     greedy_match=min(greedy) if greedy else 0, greedy_steps=greedy_steps,
                     positions=int(kl.numel()), greedy_tie_gap=max(gaps) if gaps else None)
