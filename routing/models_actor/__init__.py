"""Fleet model placement's actor: carries out `routing.core.model_placement.decide` on the
router-mode hosts that load no model on demand (routing/models_actor/actor.py)."""
