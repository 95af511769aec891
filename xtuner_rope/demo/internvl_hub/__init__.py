"""Remote code of the tiny InternVL checkpoint (``demo.tiny_internvl``), copied into it.

These files are not imported from here: ``save_tiny_internvl`` copies them next to the
checkpoint's weights, with XTuner's InternViT and InternLM2 modeling files, and
``transformers`` loads them from there (``trust_remote_code=True``), as it loads the hub's
``OpenGVLab/InternVL2-*`` code. They stand in for that code, which cannot be downloaded here:
written for xtuner-rope, with the attribute and config names XTuner 0.2.0 reads.
"""
