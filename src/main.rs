fn main() {
    std::process::exit(sentinel_gateway::cli::main());
}
