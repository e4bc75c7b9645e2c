"""The models the server answers to: GET /v1/models and the `model` field check."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.entrypoints.openai.protocol import ModelCard, ModelList


@dataclass
class OpenAIServingModels:
    """Served model names (the first is the default) and what they point to."""

    served_model_names: list[str]
    model_path: str
    max_model_len: int

    @property
    def default_name(self) -> str:
        """The name a request without `model` gets."""
        return self.served_model_names[0]

    def resolve(self, name: str | None) -> str | None:
        """The served name a request's `model` refers to (None -> default); None if unknown."""
        if name is None or name == "":
            return self.default_name
        return name if name in self.served_model_names else None

    def show_available_models(self) -> ModelList:
        """The body of GET /v1/models."""
        return ModelList(
            data=[
                ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
                for name in self.served_model_names
            ]
        )
