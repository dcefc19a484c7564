"""Teacher distillation: the teacher pipelines (rewrite, summary, MoC) that write distilled records, and the
data stage that turns them into SFT datasets (corpus preparation, sampling, build-sft, dataset cards, push)."""
