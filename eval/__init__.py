"""qsinkkv.eval: how much error each KV-cache scheme costs, per layer and end to end.

``qsinkkv-eval`` (``qsinkkv.eval.cli``) runs the subcommands kv, ppl, stream, calibrate and
report. ``schemes`` defines what each compared cache stores; ``replay`` turns that into the
attention each query sees at its decode step.
"""
