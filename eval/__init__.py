"""qsinkkv.eval: how much error each KV-cache scheme costs, per layer and end to end.

``qsinkkv-eval`` (``qsinkkv.eval.cli``) runs the subcommands kv, ppl, stream, calibrate,
report, frontier, tune and recall. ``schemes`` defines what each compared cache stores; ``replay``
turns that into the attention each query sees at its decode step (either position contract);
``footprint`` reads the bytes each cache holds from its real storage; ``frontier`` sweeps
configurations against bytes and picks one for a budget; ``recall`` asks each cache for a pass key
hidden at a distance (``passkey`` builds the prompts and counts the answers).
"""
