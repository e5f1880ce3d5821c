"""A toy target, a mixed lookup + drafter proposal, the rejection rule, and a chi-square test: the instruments
of tests/test_spec_rejection_lookup.py.

The target is a Markov chain over a small vocabulary: p(. | previous token) = softmax(W[prev] / T) after
top-k/top-p. One verify step drafts a block of K positions from the last emitted token; each position is
filled either by the lookup (a point mass on lookup_map[previous draft]: q = one-hot) or by the drafter
(greedy: one-hot on its argmax; sampled: a draw from its own q). The rule (vLLM's): keep draft x with
probability min(1, p(x) / q(x)); at the first rejection emit a token from normalize(max(p - q, 0)); when
every draft is kept, a bonus token from p. Emitted tokens, continued by further steps, must be distributed
exactly as the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOOKUP, GREEDY, SAMPLED = "lookup", "greedy", "sampled"
RULE_BROKEN = ("residual_p", "accept_p")  # residual from p itself; accept with p(x) ignoring q


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = 0  # 0: off
    top_p: float = 1.0


def processed_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k, then to the smallest top-p nucleus (ties by index)."""
    probs = torch.softmax(logits.double() / s.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = probs.argsort(dim=-1, descending=True, stable=True)
    if s.top_k:
        ranks = order.argsort(dim=-1)
        keep &= ranks < s.top_k
    if s.top_p < 1.0:
        sorted_probs = (probs * keep).gather(-1, order)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
        keep &= torch.zeros_like(keep).scatter(-1, order, before < s.top_p * sorted_probs.sum(-1, keepdim=True))
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


@dataclass(frozen=True)
class Toy:
    """The target chain, the drafter's chain and the lookup's choice, all indexed by the previous token."""

    target: torch.Tensor  # [V, V] processed target rows p(. | prev)
    drafter: torch.Tensor  # [V, V] drafter rows q(. | prev) (sampled positions)
    lookup_map: torch.Tensor  # [V] the token the lookup proposes after prev
    start: int  # the context's last token

    @classmethod
    def make(cls, vocab: int, sampling: Sampling, seed: int = 0) -> Toy:
        gen = torch.Generator().manual_seed(seed)
        target = processed_probs(2.0 * torch.randn(vocab, vocab, generator=gen), sampling)
        # the drafter is a different chain, truncated the same way (vLLM samples drafts from the target's support)
        drafter = processed_probs(2.0 * torch.randn(vocab, vocab, generator=gen), sampling)
        lookup_map = torch.randperm(vocab, generator=gen)
        return cls(target, drafter, lookup_map, 0)

    @property
    def vocab(self) -> int:
        return self.target.shape[0]

    def exact_joint(self, length: int) -> torch.Tensor:
        """[V ** length] probability of every `length`-token continuation of `start`, first token most significant."""
        joint = self.target[self.start]
        for _ in range(length - 1):
            last = torch.arange(joint.numel()) % self.vocab  # each cell's last token
            joint = (joint.unsqueeze(-1) * self.target[last]).reshape(-1)
        return joint

    def propose(self, prev: torch.Tensor, kinds: tuple[str, ...], gen: torch.Generator,
                lookup_as_drafter: bool = False):
        """Drafts [N, K] from the last emitted tokens [N], and each position's proposal q [N, K, V].

        lookup_as_drafter (a broken proposal): the lookup's positions report the drafter's q, not a point mass."""
        drafts, qs = [], []
        for kind in kinds:
            if kind == LOOKUP:
                x = self.lookup_map[prev]
                q = self.drafter[prev] if lookup_as_drafter else torch.nn.functional.one_hot(x, self.vocab).double()
            elif kind == GREEDY:
                x = self.drafter[prev].argmax(-1)
                q = torch.nn.functional.one_hot(x, self.vocab).double()
            else:
                q = self.drafter[prev]
                x = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            drafts.append(x)
            qs.append(q)
            prev = x
        return torch.stack(drafts, 1), torch.stack(qs, 1)

    def verify_rows(self, prev: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The target rows a verify step sees [N, K + 1, V]: row j conditions on the context and drafts 1..j."""
        return self.target[torch.cat([prev.unsqueeze(1), drafts], 1)]


def rejection_step(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, gen: torch.Generator,
                   broken: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, vectorised over N requests: (emitted [N, K + 1] padded with -1, number emitted [N])."""
    n, k = drafts.shape
    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ratio = p_draft if broken == "accept_p" else p_draft / q_draft
    kept = torch.rand(n, k, generator=gen, dtype=torch.float64) < ratio
    accepted = kept.long().cumprod(1).sum(1)  # drafts kept before the first rejection
    rows = torch.arange(n)
    p_at = p[rows, accepted]  # the rejected position's row, or the bonus row when all were kept
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]  # no proposal at the bonus position
    residual = p_at if broken == "residual_p" else (p_at - q_at).clamp_min(0)
    # a rejection leaves mass: p - q sums to 0 only when p == q, where the draft is always kept
    last = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=gen).squeeze(-1)
    emitted = torch.full((n, k + 1), -1, dtype=torch.long)
    positions = torch.arange(k + 1)
    emitted[:, :k] = torch.where(positions[:k] < accepted.unsqueeze(1), drafts, -1)
    emitted[rows, accepted] = last
    return emitted, accepted + 1


def sample_sequences(toy: Toy, kinds: tuple[str, ...], n: int, length: int, seed: int,
                     broken: str | None = None, lookup_as_drafter: bool = False) -> torch.Tensor:
    """n continuations of `length` tokens, each produced by as many verify steps as it takes: [n, length]."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((n, length), -1, dtype=torch.long)
    filled = torch.zeros(n, dtype=torch.long)
    prev = torch.full((n,), toy.start, dtype=torch.long)
    while (todo := (filled < length).nonzero().squeeze(-1)).numel():
        drafts, q = toy.propose(prev[todo], kinds, gen, lookup_as_drafter)
        emitted, count = rejection_step(toy.verify_rows(prev[todo], drafts), q, drafts, gen, broken)
        take = torch.minimum(count, length - filled[todo])
        for j in range(emitted.shape[1]):
            rows = todo[j < take]
            out[rows, filled[rows] + j] = emitted[j < take, j]
        filled[todo] += take
        prev[todo] = out[todo, filled[todo] - 1]
    return out


def continue_exactly(toy: Toy, emitted: torch.Tensor, count: torch.Tensor, length: int, seed: int) -> torch.Tensor:
    """One verify step's output [N, K + 1], cut or continued to `length` tokens by sampling the chain itself."""
    gen = torch.Generator().manual_seed(seed)
    n = emitted.shape[0]
    out = torch.full((n, length), -1, dtype=torch.long)
    width = min(length, emitted.shape[1])
    out[:, :width] = emitted[:, :width]
    prev = torch.full((n,), toy.start, dtype=torch.long)
    for j in range(length):
        fresh = torch.multinomial(toy.target[prev], 1, generator=gen).squeeze(-1)
        out[:, j] = torch.where(j < count, out[:, j], fresh)
        prev = out[:, j]
    return out


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    df: int
    p_value: float
    outside_support: int  # samples in cells the target gives probability 0


MIN_EXPECTED = 5.0  # cells expected to hold fewer samples are pooled into one (Pearson's approximation needs it)


def chi_square(sequences: torch.Tensor, vocab: int, exact: torch.Tensor) -> ChiSquare:
    """Pearson's test of the sequences' cell counts against `exact` (cells of zero probability must stay empty)."""
    length = sequences.shape[1]
    if (sequences < 0).any():
        raise ValueError("a sequence holds no token at some position")
    weights = vocab ** torch.arange(length - 1, -1, -1)
    counts = torch.bincount((sequences * weights).sum(1), minlength=vocab**length).double()
    expected = exact * sequences.shape[0]
    support = exact > 0
    large = expected >= MIN_EXPECTED
    small = support & ~large
    observed = torch.cat([counts[large], counts[small].sum().reshape(1)])
    wanted = torch.cat([expected[large], expected[small].sum().reshape(1)])
    if not small.any():
        observed, wanted = observed[:-1], wanted[:-1]
    stat = float(((observed - wanted) ** 2 / wanted).sum())
    df = observed.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return ChiSquare(stat, df, p_value, int(counts[~support].sum()))



def vllm_step(toy: Toy, kinds: tuple[str, ...], n: int, seed: int, temperature: float,
              lookup_as_drafter: bool = False, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One verify step for n requests through vLLM 0.28.0's V2-runner rejection kernels: (emitted [n, K + 1]
    padded with -1, number emitted [n]). The drafts come from `toy.propose`; the target rows go in as the
    processed logits the sampler hands over (log p, -inf outside the top-k/top-p support), the proposals as
    draft logits, which the kernels divide by the temperature: T * log q (a point mass: 0 on its token, -inf
    elsewhere). On a CPU host it needs TRITON_INTERPRET=1 and `interpreter_libdevice`; device="cuda" runs the
    kernels compiled (the results come back to the CPU)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    gen = torch.Generator().manual_seed(seed)
    k = len(kinds)
    prev = torch.full((n,), toy.start, dtype=torch.long)
    drafts, q = toy.propose(prev, kinds, gen, lookup_as_drafter)
    target_logits = toy.verify_rows(prev, drafts).log().float().reshape(n * (k + 1), toy.vocab)
    draft_logits = (temperature * q.log()).float()  # [n, K, V]: request state index = request index
    rows = torch.arange(n, dtype=torch.int32)
    inputs = [
        target_logits.contiguous(),
        draft_logits.contiguous(),
        torch.cat([prev.unsqueeze(1), drafts], 1).reshape(-1),  # input ids at the logits: last token, then drafts
        torch.arange(0, n * (k + 1) + 1, k + 1, dtype=torch.int32),
        (100 + torch.arange(k + 1)).repeat(n),  # positions in the sequence: the noise's offset
        rows,
        rows.repeat_interleave(k + 1),
        torch.arange(k + 1, dtype=torch.int32).repeat(n),
        torch.full((n,), temperature, dtype=torch.float32),
        torch.randint(0, 2**62, (n,), generator=gen, dtype=torch.int64),  # one seed per request: independent draws
    ]
    sampled, num_sampled = rejection_sample(*(t.to(device) for t in inputs), k)
    sampled, count = sampled.cpu(), num_sampled.long().cpu()
    emitted = torch.where(torch.arange(k + 1) < count.unsqueeze(1), sampled, -1)
    return emitted, count


def interpreter_libdevice(monkeypatch) -> None:
    """Triton's CPU interpreter leaves libdevice unimplemented; vLLM's rejection and Gumbel kernels call
    log1p from it. log(1 + x) stands in (float32: the same values up to rounding for these tiny vocabularies)."""
    import triton.language as tl
    from triton.language.extra import libdevice

    monkeypatch.setattr(libdevice, "log1p", lambda x: tl.log(1.0 + x))
