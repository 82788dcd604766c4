"""The ``tensor_keys`` / ``set_keys`` protocol of TorchRL's objectives, for modules that are not
``LossModule`` s (the advantage transforms and the DAPO filter)."""

from __future__ import annotations


class KeysMixin:
    """Needs a ``_AcceptedKeys`` dataclass and ``default_keys = _AcceptedKeys`` on the class; call
    ``self._tensor_keys = self._AcceptedKeys()`` in ``__init__``."""

    @property
    def tensor_keys(self):
        return self._tensor_keys

    def set_keys(self, **kwargs) -> None:
        """Sets tensordict key names, e.g. ``module.set_keys(reward=("next", "reward"))``; ``None`` resets."""
        for key, value in kwargs.items():
            if key not in self._AcceptedKeys.__dataclass_fields__:
                raise ValueError(
                    f"{key} is not an accepted tensordict key. Accepted keys are: "
                    f"{list(self._AcceptedKeys.__dataclass_fields__)}."
                )
            setattr(self._tensor_keys, key, value if value is not None else getattr(self.default_keys(), key))
        self._keys_changed()

    def _keys_changed(self) -> None:
        """Hook: keep ``in_keys``/``out_keys`` in step with the tensor keys."""
