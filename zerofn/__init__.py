"""zerofn: DeepSpeed's ZeRO as composable transforms over a pure training step."""
