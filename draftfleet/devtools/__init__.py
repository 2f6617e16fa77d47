"""Development tools the product ships (the emulator of SGLang and OpenRouter, the demo, the sample
data): used by tests, benchmarks and the demo, never on the production path."""
