"""What XTuner's dataloader runs: collate functions and the lossless pack step.

- ``collate``: ``rope_collate_fn`` (padded or packed batches with per-document positions);
- ``collate_llava``: ``llava_collate_fn`` (the same for LLaVA's image placeholders);
- ``packed_dataset``: ``lossless_process_hf_dataset`` (XTuner's packing without dropped shards).
"""
