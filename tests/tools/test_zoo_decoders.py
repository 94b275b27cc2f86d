"""KerasHub's causal LMs (GPT-2, Llama with grouped-query attention, Gemma with one key/value
head, Mistral) under mixed_float16 and mixed_bfloat16: the checks of `zoo_cases`.
"""

from zoo_cases import *  # noqa: F403  (the shared tests)
from zoo_cases import make_fixtures

zoo_run, float32_losses = make_fixtures(("gpt2", "llama", "gemma", "mistral"))
