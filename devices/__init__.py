"""Device side: the agent for physical boards, the virtual fleet, profiles and models."""
