"""Straggler detection and NVIDIA's fault-tolerance package: flags accepted so that upstream launch scripts
parse, and stopped at validation with what to do instead. Upstream's straggler detector reads GPU clocks and
power through NVML; the fault-tolerance flags drive `nvidia_resiliency_ext`'s rank monitor. Neither is wired
into this training loop, so running on without them would silently drop what the flag asked for."""

import importlib.util


def add_arguments(parser):
    group = parser.add_argument_group("straggler detection and fault tolerance")
    group.add_argument("--log-straggler", action="store_true",
                       help="Upstream: report the slowest ranks (NVML); not supported here, stops at validation.")
    group.add_argument("--disable-straggler-on-startup", action="store_true",
                       help="Upstream: start the straggler detector switched off (with --log-straggler).")
    group.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                       help="Upstream: port of the straggler detector's on/off control server (with --log-straggler).")
    group.add_argument("--straggler-minmax-count", type=int, default=1,
                       help="Upstream: how many slowest and fastest ranks to report (with --log-straggler).")
    group.add_argument("--enable-ft-package", action="store_true",
                       help="Upstream: heartbeats to nvidia-resiliency-ext's rank monitor; not supported here, stops "
                       "at validation.")
    group.add_argument("--calc-ft-timeouts", action="store_true",
                       help="Upstream: let nvidia-resiliency-ext measure its timeouts; not supported here, stops at "
                       "validation.")


def _package_note(module_name, pip_name):
    if importlib.util.find_spec(module_name) is None:
        return f"{pip_name} is not installed, and this training loop does not call it either"
    return f"{pip_name} is installed, but this training loop does not call it"


def validate(args):
    if args.log_straggler:
        raise ValueError(f"--log-straggler needs upstream's NVML straggler detector ({_package_note('pynvml', 'pynvml')}"
                         "): drop --log-straggler (and --disable-straggler-on-startup, --straggler-ctrlr-port, "
                         "--straggler-minmax-count); --timing-log-option minmax or all shows the slowest rank's "
                         "step times instead")
    for flag, enabled in (("--enable-ft-package", args.enable_ft_package),
                          ("--calc-ft-timeouts", args.calc_ft_timeouts)):
        if enabled:
            raise ValueError(f"{flag} needs NVIDIA's fault-tolerance integration "
                             f"({_package_note('nvidia_resiliency_ext', 'nvidia-resiliency-ext')}): drop {flag}; "
                             "restart failed jobs from the last checkpoint with --load instead")
    if args.straggler_minmax_count < 1:
        raise ValueError(f"--straggler-minmax-count must be >= 1, got {args.straggler_minmax_count}")
    if not 0 < args.straggler_ctrlr_port < 65536:
        raise ValueError(f"--straggler-ctrlr-port must be a port number in 1..65535, got {args.straggler_ctrlr_port}")
