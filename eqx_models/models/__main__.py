"""`python -m eqx_models.models`: the docs fragments generated from the registry
(the table of docs/models/index.md, the README's list of families)."""

from . import models_sentence, models_table

print(models_table(), end="\n\n")
print(models_sentence())
