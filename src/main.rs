#[global_allocator]
static ALLOCATOR: sentinel_gateway::Allocator = sentinel_gateway::ALLOCATOR;

fn main() {
    let code = sentinel_gateway::cli::main();
    sentinel_gateway::telemetry::flush();
    std::process::exit(code);
}
