#[global_allocator]
static ALLOCATOR: sentinel_gateway::Allocator = sentinel_gateway::ALLOCATOR;

fn main() {
    std::process::exit(sentinel_gateway::cli::main());
}
