"""What XTuner's dataloader runs: collate functions and the offline pack steps.

- ``collate``: ``rope_collate_fn`` (padded or packed batches with per-document positions);
- ``collate_llava``: ``llava_collate_fn`` (the same for LLaVA's image placeholders);
- ``packed_dataset``: ``lossless_process_hf_dataset`` (XTuner's packing with each dialogue whole
  in one row and nothing dropped; ``offline_packing = "cut"`` keeps XTuner's cut);
- ``pack_plans``: where offline packing puts each token (``whole_plan``, ``cut_plan``);
- ``token_gather``: the packed rows' tokens read from the mapped tokenized table, no copy of it;
- ``token_lines``: the intern-repo ``.bin`` lines of a packed row parsed in one pyarrow JSON read;
- ``intern_repo_packing``: ``build_whole_packed_dataset`` (the intern-repo packer, documents whole).
- ``truncation`` / ``preference_truncation``: XTuner's cut at ``max_length`` counted (dialogues,
  documents; preference pairs), the data unchanged.
"""
