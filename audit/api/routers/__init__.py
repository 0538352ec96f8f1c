"""One router per concern; ``audit.api.app`` mounts them."""
