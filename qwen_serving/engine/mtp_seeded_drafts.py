"""Probabilistic drafts that follow the request's seed (mtp-seeded-drafts.patch, and mtp_draft_vocab's sampler).

A draft is an exponential race, argmax q / E with E ~ Exp(1) i.i.d. per column. vLLM 0.28.0's V1 proposer draws
E from the global RNG for every row (``compute_probs_and_sample_next_token``: "TODO(woosuk): Consider seeds"), and
so did our draft head's sampler: two runs of one seeded request then draft different tokens, the rejection
sampler accepts different ones and its own seeded draws land elsewhere in the request's stream, and the text
diverges a few tokens in (bench/api_smoke.py's ``seed`` check failed on every MTP server). vLLM's sampler and
rejection sampler draw a seeded request's noise from its own ``torch.Generator``
(``sampling_metadata.generators``); ``exponential_`` does the same for the drafts.

Rows: in ``propose``'s draft passes the drafter samples ``[:batch_size]``, the input batch's requests in its order
(the runner hands the drafter unpadded metadata; CUDA-graph padding is only in the forward's inputs), which is how
``generators`` is keyed; a parallel drafter samples ``rows_per_request`` consecutive rows a request. A request's
generator is drawn in launch order on the host, the same every run: the bonus sampler, the rejection sampler
(uniforms, recovered tokens), then ``propose``'s k drafts, one draw a seeded row a draft. Rows whose sampled token
the step discards (partial prefills) draft from the global RNG (``drafting_metadata``), as vLLM rewinds its
sampler's draw for them, so the stream does not depend on how the prompt was chunked.
"""

from __future__ import annotations

import dataclasses

import torch


def exponential_(noise: torch.Tensor, generators: dict[int, torch.Generator],
                 rows_per_request: int = 1) -> torch.Tensor:
    """Fill ``noise`` [rows, columns] with Exp(1) draws: a seeded request's rows from its generator, the others
    from the global RNG. Without seeded rows exactly ``noise.exponential_()``: no host loop, no device read."""
    # the global draw only where some row is unseeded (vLLM's random_sample skips it too)
    if len(generators) * rows_per_request < noise.shape[0]:
        noise.exponential_()
    for request, generator in generators.items():  # seeded requests only
        noise[request * rows_per_request:(request + 1) * rows_per_request].exponential_(generator=generator)
    return noise


def drafting_metadata(sampling_metadata, discarded):
    """vLLM hook (``GPUModelRunner.propose_draft_token_ids``): the sampling metadata the drafter gets, the
    generators of rows whose sampled token is discarded (``discarded``: the step's host mask, a partial prefill)
    left out. vLLM rewinds such a row's generator by the sampler's one draw; its drafts would move it further."""
    generators = sampling_metadata.generators
    if not generators:
        return sampling_metadata
    kept = {row: generator for row, generator in generators.items() if not discarded[row]}
    if len(kept) == len(generators):
        return sampling_metadata
    return dataclasses.replace(sampling_metadata, generators=kept)
