"""Mistral: Llama's shape, sliding on every layer where config.json gives a window. llama.cpp
writes its GGUFs as architecture llama."""

from model.families.family import Family


class Mistral(Family):
    model_type, architecture = "mistral", "MistralForCausalLM"


FAMILY = Mistral()
