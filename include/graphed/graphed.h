#pragma once

/// \file graphed.h
/// Everything graphed offers LibTorch programs. Link the `graphed::graphed`
/// CMake target (find_package(graphed)) and include this header.

#include "graphed/advice.h"
#include "graphed/bucket_policy.h"
#include "graphed/capture.h"
#include "graphed/capture_blockers.h"
#include "graphed/capture_watcher.h"
#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "graphed/decoder.h"
#include "graphed/grad_guard.h"
#include "graphed/graph.h"
#include "graphed/graph_schedule.h"
#include "graphed/graphed_callable.h"
#include "graphed/graph_manager.h"
#include "graphed/optim.h"
#include "graphed/profile.h"
#include "graphed/safety_check.h"
#include "graphed/signature.h"
#include "graphed/source_location.h"
#include "graphed/state_snapshot.h"
#include "graphed/static_io.h"
#include "graphed/tensor_identity.h"
#include "graphed/train_step.h"
#include "graphed/training_iteration.h"
#include "graphed/version.h"
