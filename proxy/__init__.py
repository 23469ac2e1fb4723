"""Emulator side: wire codec, server, registry, scheduler, virtual clock, job runtime."""
