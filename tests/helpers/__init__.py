"""Shared test machinery: a live server and a headless browser, live job services, a raw Gradio client."""
