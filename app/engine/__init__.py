"""The engine: app.server talks to Engine, which drives the planner, the output processor and
model's runner."""

from app.engine.engine import Engine, EngineConfig
from app.engine.errors import Draining, EngineError, Overloaded
from app.engine.request import Frame, GenerationParams, ThinkingBudget, Usage

__all__ = ["Draining", "Engine", "EngineConfig", "EngineError", "Frame", "GenerationParams", "Overloaded",
           "ThinkingBudget", "Usage"]
