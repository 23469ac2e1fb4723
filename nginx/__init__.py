"""The Nginx stream (layer-4) proxy in front of the emulator for physical devices.

``conf`` renders an ``nginx.conf`` from a few settings (sans-IO: text in, text
out), ``cli`` is ``morphling nginx-config``, and ``harness`` runs a real nginx
in the foreground for tests and trials.
"""
