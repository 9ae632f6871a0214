"""FlowGRPO on a real diffusers pipeline with a low-precision rollout engine (``rollout-correction diffusion-demo``).

``model`` (tiny ``SD3Transformer2DModel``, prompts, reward, warm start), ``engine`` (the serving
copy: bf16 / fp8 weights, fp32 scheduler step), ``trainer`` (fp32 recompute, correction, update),
``runner`` (variants, mismatch scan), ``report`` (results file, tables, plots), ``cli``.
Needs the ``diffusion`` extra (diffusers).
"""
