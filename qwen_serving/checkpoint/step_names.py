"""The names prepare/'s steps record in prepared.json, standard library only: the serve plan reads them
(qwen_serving/plan.py lists the first-start steps not yet recorded) without importing numpy."""

QUANT_LM_HEAD = "quant_lm_head"
QUANT_EMBED = "quant_embed"
QUANT_MTP = "quant_mtp"
DRAFT_VOCAB = "draft_vocab"
