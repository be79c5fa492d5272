"""ldm-ui, the local web app (the `ui` extra): `runs` does the work without Gradio, `app` lays out the tabs."""
