"""The shapes demo: a procedural text-to-image domain (coloured shapes on coloured backgrounds), the pixel
checker reward, the held-out evaluator, and the commands that pretrained the shipped tiny models.

A leaf: it uses the core, and the core reaches it only through registry names (``model.pretrained:
tiny-shapes``, ``data.prompt_set: shapes-train``, ``log.eval: shapes``, the ``shapes`` reward)."""
