"""The application layer (issue #24): workflows above the models — reading files, loading exports, long-form
windows, timing, formats. ``omni.pipelines.transcribe`` holds Whisper's long-form loop."""
