"""The publish: the WeightPublisher facade, its steps (plan, slot, stage, seal, send) and publish_async."""
